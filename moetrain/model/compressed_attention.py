"""DeepSeek-V4's attention: one key/value head read as both keys and values (K = V), a sliding
window, and on compressed layers the entries of a compressor appended to the window's keys;
attention sinks per head, and a grouped low-rank output projection.

Per layer (``kind``):

- ``sliding``: each query attends to the last ``window`` positions (itself included);
- ``hca`` (heavily compressed attention): also to the compressed entries of every window of
  ``rate`` tokens that has closed by its position (entry w, tokens ``[w m, (w+1) m)``, is
  seen from position ``(w + 1) m - 1`` on);
- ``csa`` (compressed sparse attention): entries of overlapping windows (entry w pools window
  w's second series with window w-1's first series, 2m slots) of which a lightning indexer
  keeps each query's ``index_topk`` best among the closed ones.

A compressed entry is a softmax-gated sum of its window's ``wkv`` projections (the gates
``wgate`` plus a learned per-slot ``position_bias``), RMS-normalised, its trailing RoPE slice
rotated at the window's first position. The queries go through a low-rank ``wq_a`` (normed;
the indexer reads it too) and ``wq_b``, each head RMS-normalised without a weight; the single
key/value head is ``kv_norm(wkv x)``. RoPE rotates the trailing ``rope_dim`` channels of each
head in adjacent pairs; since the values are the rotated keys, the output's RoPE slice is
rotated back at the query's position. The heads' outputs, in ``o_groups`` groups, go through
``wo_a`` (one block per group, to ``o_lora_rank``) and ``wo``. Sinks: a learned logit per
head beside the keys, dropped after the softmax.

The attention itself is :mod:`moetrain.model.compressed_kernel`'s, a block of queries at a time
(no (S, S) tensor); the indexer scores as many queries at a time as keep its score table
under ``INDEX_SCORES`` values. The indexer's selection carries no gradient (as transformers').

Shape legend: B batch, S sequence, H heads, D d_model, K head dim, W compressed entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from moetrain.model import compressed_kernel
from moetrain.model.compressed_kernel import window_entry_attention, window_entry_logit_max
from moetrain.model.cpu_matmul import Linear
from moetrain.model.layers import RMSNorm
from moetrain.model.rope import yarn_inv_freq

Kind = Literal["sliding", "csa", "hca"]
INDEX_SCORES = 1 << 20  # the indexer scores as many queries at once as keep its table this small


@dataclass(frozen=True)
class CompressedAttentionShape:
    """What one layer's attention is built from (DeepSeek-V4's config names in brackets)."""

    d_model: int
    n_heads: int  # (num_attention_heads)
    head_dim: int  # (head_dim)
    rope_dim: int  # the trailing channels RoPE turns (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # (sliding_window)
    kind: Kind = "sliding"
    rate: int = 4  # the compressor's window (compress_rates of the layer's type)
    index_heads: int = 0  # (index_n_heads; csa)
    index_head_dim: int = 0  # (index_head_dim)
    index_topk: int = 0  # (index_topk)
    norm_eps: float = 1e-6


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` (..., S, K) in adjacent pairs
    by the rows ``cos`` / ``sin`` (S, R/2) (in fp32), the leading channels untouched; ``back``:
    by the opposite angles. Its backward is the opposite rotation of the gradient (nothing of
    ``x`` saved)."""
    return _RotatePairs.apply(x, cos, sin, back)


def _turned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: bool) -> torch.Tensor:
    """The trailing ``2 * cos.shape[-1]`` channels of ``x`` rotated (fp32, cast back)."""
    pairs = x[..., -2 * cos.shape[-1] :].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.float(), sin.float()
    if back:
        turned = torch.stack((a * cos + b * sin, b * cos - a * sin), dim=-1)
    else:
        turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return turned.flatten(-2).to(x.dtype)


class _RotatePairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, back):  # noqa: ANN001, ANN205
        out = x.clone()
        out[..., -2 * cos.shape[-1] :] = _turned(x, cos, sin, back)
        ctx.save_for_backward(cos, sin)
        ctx.back = back
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        cos, sin = ctx.saved_tensors
        d_x = grad.clone()
        d_x[..., -2 * cos.shape[-1] :] = _turned(grad, cos, sin, not ctx.back)
        return d_x, None, None, None


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """A weightless RMSNorm over the last dim, ``x * rsqrt(mean(x^2) + eps)`` in fp32 (as
    :func:`moetrain.model.attention.unit_rms`), with a written backward ``r (g - y mean(g y))``
    (saves the fp32 input and ``r``)."""
    return _UnitRms.apply(x, eps)


class _UnitRms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):  # noqa: ANN001, ANN205
        x32 = x.float()
        r = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x32, r)
        return (x32 * r).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x32, r = ctx.saved_tensors
        g, y = grad.float(), x32 * r
        d_x = torch.addcmul(g, y, (g * y).mean(-1, keepdim=True), value=-1.0).mul_(r)
        return d_x.to(grad.dtype), None


def pair_rope_rows(
    positions: int,
    rope_dim: int,
    theta: float,
    yarn: tuple[float, int, float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (positions, rope_dim / 2) cos / sin of positions ``0 .. positions - 1`` for
    :func:`rotate_pairs`: one frequency per pair, of base ``theta``, or YaRN's with ``yarn =
    (factor, original_len, beta_fast, beta_slow)`` and attention factor 1 (DeepSeek-V4's
    compressed layers leave cos / sin unscaled)."""
    if yarn is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    else:
        inv_freq = yarn_inv_freq(rope_dim, theta, *yarn)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


class Compressor(nn.Module):
    """Entries of windows of ``rate`` tokens, each of width ``dim`` (module docstring);
    ``overlap``: the csa layout (two series per token, 2m slots per entry)."""

    def __init__(self, d_model: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(d_model, width, bias=False)
        self.wgate = Linear(d_model, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, eps)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, W, dim) entries of the ``W = S // rate`` closed windows, rotated at ``w * rate``."""
        b, s, _ = x_BSD.shape
        m, d = self.rate, self.dim
        w = s // m
        if w == 0:  # no window closed yet
            return x_BSD.new_zeros(b, 0, d)
        kv = self.wkv(x_BSD[:, : w * m]).unflatten(1, (w, m))
        gate = self.wgate(x_BSD[:, : w * m]).unflatten(1, (w, m)) + self.position_bias
        if self.overlap:  # slots: window w-1's first series, then window w's second
            first_kv = torch.cat((kv.new_zeros(b, 1, m, d), kv[:, :-1, :, :d]), dim=1)
            first_gate = torch.cat(
                (gate.new_full((b, 1, m, d), float("-inf")), gate[:, :-1, :, :d]), 1
            )
            kv = torch.cat((first_kv, kv[..., d:]), dim=2)
            gate = torch.cat((first_gate, gate[..., d:]), dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(2))
        return rotate_pairs(entries, cos[: w * m : m], sin[: w * m : m])

    @torch.no_grad()
    def init_own_parameters(self) -> None:
        nn.init.zeros_(self.position_bias)


class Indexer(nn.Module):
    """csa's lightning indexer: per query, ``sum_h w_h relu(q_h . k_w)`` over compressed keys
    of its own compressor; keeps the ``index_topk`` best closed entries."""

    def __init__(self, shape: CompressedAttentionShape) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = shape.index_heads, shape.index_head_dim, shape.index_topk
        self.compressor = Compressor(shape.d_model, self.dim, shape.rate, True, shape.norm_eps)
        self.wq_b = Linear(shape.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = Linear(shape.d_model, self.heads, bias=False)

    @torch.no_grad()
    def forward(
        self, x_BSD: torch.Tensor, q_low: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's picks ``(idx_BSk, valid_BSk)``: its ``index_topk`` best entries (fewer
        where fewer exist), valid where closed by its position; scored a block of queries at
        a time (module docstring)."""
        b, s, _ = x_BSD.shape
        keys_BKW = self.compressor(x_BSD, cos, sin).float().transpose(1, 2)
        n, rate, dev = keys_BKW.shape[2], self.compressor.rate, x_BSD.device
        q = self.wq_b(q_low).view(b, s, self.heads, self.dim)
        q = rotate_pairs(q, cos[:s, None], sin[:s, None]).float()  # (B, S, Hi, Ki)
        head_w = self.weights_proj(x_BSD).float() * self.heads**-0.5
        k = min(self.topk, n)
        idx = torch.zeros(b, s, k, dtype=torch.long, device=dev)
        valid = torch.zeros(b, s, k, dtype=torch.bool, device=dev)
        block = max(compressed_kernel.BLOCK, INDEX_SCORES // max(1, b * self.heads * n))
        for start in range(0, s, block):
            stop = min(s, start + block)
            scores = torch.bmm(q[:, start:stop].flatten(1, 2), keys_BKW)  # (B, Q Hi, W)
            scores = scores.view(b, stop - start, self.heads, n).relu_().mul_(self.dim**-0.5)
            score_BQW = scores.mul_(head_w[:, start:stop, :, None]).sum(2)
            closed_Q = torch.arange(start + 1, stop + 1, device=dev)[:, None] // rate
            score_BQW.masked_fill_(torch.arange(n, device=dev) >= closed_Q, float("-inf"))
            picks = score_BQW.topk(k, dim=-1).indices
            idx[:, start:stop] = picks
            valid[:, start:stop] = picks < closed_Q
        return idx, valid

    def init_own_parameters(self) -> None:
        self.compressor.init_own_parameters()


class CompressedAttention(nn.Module):
    """One layer's attention (module docstring): ``forward(x_BSD, cos, sin) -> (B, S, D)``
    with the RoPE rows of positions ``0 .. S - 1`` (S, rope_dim / 2) of its own theta (the
    compressed layers' and their compressor's, or the sliding layers')."""

    def __init__(self, shape: CompressedAttentionShape) -> None:
        super().__init__()
        self.shape = sh = shape
        if sh.n_heads % sh.o_groups:
            raise ValueError(f"o_groups={sh.o_groups} must divide n_heads={sh.n_heads}")
        self.wq_a = Linear(sh.d_model, sh.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(sh.q_lora_rank, sh.norm_eps)
        self.wq_b = Linear(sh.q_lora_rank, sh.n_heads * sh.head_dim, bias=False)
        self.wkv = Linear(sh.d_model, sh.head_dim, bias=False)
        self.kv_norm = RMSNorm(sh.head_dim, sh.norm_eps)
        per_group = sh.n_heads * sh.head_dim // sh.o_groups
        self.wo_a = nn.Parameter(torch.empty(sh.o_groups * sh.o_lora_rank, per_group))
        self.wo = Linear(sh.o_groups * sh.o_lora_rank, sh.d_model, bias=False)
        self.sinks = nn.Parameter(torch.zeros(sh.n_heads))
        self.compressor = self.indexer = None
        if sh.kind != "sliding":
            eps = sh.norm_eps
            self.compressor = Compressor(sh.d_model, sh.head_dim, sh.rate, sh.kind == "csa", eps)
        if sh.kind == "csa":
            self.indexer = Indexer(sh)

    @torch.no_grad()
    def init_own_parameters(self, std: float = 0.02) -> None:
        """``wo_a`` Normal(0, std); sinks and position biases zeros (transformers' init)."""
        nn.init.normal_(self.wo_a, 0.0, std)
        nn.init.zeros_(self.sinks)
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.init_own_parameters()

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        sh = self.shape
        b, s, _ = x_BSD.shape
        cos, sin = cos[:s], sin[:s]
        q_low = self.q_norm(self.wq_a(x_BSD))
        q = self.wq_b(q_low).view(b, s, sh.n_heads, sh.head_dim)
        q = rotate_pairs(unit_rms(q, sh.norm_eps), cos[:, None], sin[:, None])  # (B, S, H, K)
        kv = rotate_pairs(self.kv_norm(self.wkv(x_BSD)), cos, sin)  # (B, S, K)
        entries, picks = kv[:, :0], None
        if self.compressor is not None:
            entries = self.compressor(x_BSD, cos, sin)  # (B, W, K)
            if self.indexer is not None:
                picks = self.indexer(x_BSD, q_low, cos, sin)
        rate = self.compressor.rate if self.compressor is not None else 1
        if getattr(self, "track_logits", False):  # (moetrain.model.logit_max's protocol)
            seen = window_entry_logit_max(q, kv, entries, picks, sh.window, rate, sh.head_dim**-0.5)
            old = getattr(self, "logit_max_H", None)
            self.logit_max_H = seen if old is None else torch.maximum(old, seen)
        out = window_entry_attention(
            q, kv, entries, picks, self.sinks, sh.window, rate, sh.head_dim**-0.5
        )  # (B, S, H, K)
        out = rotate_pairs(out, cos[:, None], sin[:, None], back=True)  # (values' rotation undone)
        grouped = out.reshape(b, s, sh.o_groups, -1)
        w_a = self.wo_a.view(sh.o_groups, sh.o_lora_rank, -1)
        low = torch.einsum("bsgi,goi->bsgo", grouped, w_a.to(grouped.dtype))
        return self.wo(low.flatten(2))
