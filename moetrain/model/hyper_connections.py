"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4's residual, ``model.hc_streams``).

The residual stream is N parallel streams (B, S, N, D) instead of one. Around each branch (the
token mixer, the FFN) a :class:`HyperConnection` reads all N streams and computes, per token,
from a weightless RMSNorm of their concatenation (N * D) times ``fn`` ((2 + N) * N, N * D):

- ``pre`` (N): ``sigmoid(scale_0 * a + base_a) + eps``; the branch's input is
  ``sum_n pre_n * stream_n`` (D);
- ``post`` (N): ``2 * sigmoid(scale_1 * b + base_b)``; the branch's output y is written into
  stream n as ``post_n * y``;
- ``comb`` (N, N): ``softmax(scale_2 * c + base_c)`` over its last axis, plus eps, then made
  doubly stochastic by Sinkhorn-Knopp: columns normalised once, then ``sinkhorn_iters - 1``
  times rows then columns (each divided by its sum + eps); the streams carry on mixed as
  ``new_k = sum_j comb[j, k] * stream_j + post_k * y``.

The embeddings enter as N copies; the final :class:`HyperHead` collapses the streams with its
own ``pre`` (``fn`` (N, N * D), ``base`` (N), ``scale`` (1)) before the final norm. The
coefficients are computed in fp32 (transformers keeps these modules in fp32), the streams in
their own dtype. Parameters: ``fn`` Normal(0, init_std), ``base`` zeros, ``scale`` ones.

Shape legend: B batch, S sequence, N streams, D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.model.hyper_connection_ops import collapse, mix, mixing_matrix, normed_projection


def expand_streams(x_BSD: torch.Tensor, n: int) -> torch.Tensor:
    """N copies of ``x_BSD`` as the streams (B, S, N, D)."""
    return x_BSD.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


def _coefficients(
    streams_BSND: torch.Tensor, fn: torch.Tensor, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The streams as (T, N, D) fp32 (a copy under bf16; the collapse reads them too) and the
    fp32 ``unit_rms(concat of the streams) @ fn^T`` per token (T, W)."""
    x_TND = streams_BSND.flatten(0, 1).float()
    return x_TND, normed_projection(x_TND.flatten(1), fn.float(), norm_eps)


class HyperConnection(nn.Module):
    """One branch's mHC (module docstring): ``forward(streams) -> (branch input, state)`` and
    ``mix(streams, y, state)`` -> the new streams."""

    def __init__(
        self, d_model: int, n: int, sinkhorn_iters: int, eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.n, self.sinkhorn_iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * d_model))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """``fn`` Normal(0, std), ``base`` zeros, ``scale`` ones (transformers' init)."""
        nn.init.normal_(self.fn, 0.0, std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(
        self, streams_BSND: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The branch's input (B, S, D) and ``(post_BSN, comb_BSNN)`` (fp32) for :meth:`mix`."""
        n, (b, s) = self.n, streams_BSND.shape[:2]
        x_TND, coef = _coefficients(streams_BSND, self.fn, self.norm_eps)
        pre, post, comb = coef.split([n, n, n * n], dim=-1)
        base_pre, base_post, base_comb = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * s_pre + base_pre) + self.eps
        post = 2 * torch.sigmoid(post * s_post + base_post)
        comb = comb.unflatten(-1, (n, n)) * s_comb + base_comb.view(n, n)
        comb = mixing_matrix(comb, self.sinkhorn_iters, self.eps)
        h_BSD = collapse(x_TND, pre).to(streams_BSND.dtype).view(b, s, -1)
        return h_BSD, (post.view(b, s, n), comb.view(b, s, n, n))

    @staticmethod
    def mix(
        streams_BSND: torch.Tensor, y_BSD: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """``new_k = sum_j comb[j, k] * stream_j + post_k * y`` in the streams' dtype."""
        post_BSN, comb_BSNN = state
        new_TND = mix(
            streams_BSND.flatten(0, 1), y_BSD.flatten(0, 1), post_BSN.flatten(0, 1),
            comb_BSNN.flatten(0, 1),
        )  # fmt: skip
        return new_TND.view(streams_BSND.shape)


class HyperHead(nn.Module):
    """The final collapse of the streams (module docstring): ``forward(streams) -> (B, S, D)``."""

    def __init__(self, d_model: int, n: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * d_model))
        self.base = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    reset_parameters = HyperConnection.reset_parameters

    def forward(self, streams_BSND: torch.Tensor) -> torch.Tensor:
        x_TND, coef = _coefficients(streams_BSND, self.fn, self.norm_eps)
        pre = torch.sigmoid(coef * self.scale.float() + self.base.float()) + self.eps
        return collapse(x_TND, pre).to(streams_BSND.dtype).view(streams_BSND.shape[:2] + (-1,))
