"""Grouped SwiGLU experts with stacked weights.

Shape legend: N token copies grouped by expert, D d_model, F expert hidden, L local experts.

Parameters ``w13`` (L, D, 2F) = ``[w1 | w3]`` (gate and up projections side by side) and ``w2``
(L, F, D); expert ``l`` computes ``(silu(x @ w1[l]) * (x @ w3[l]) * w) @ w2[l]`` on its
contiguous slice of x_ND, ``w`` the row's routing weight (1 when none is given). Options
(gpt-oss): biases ``w13_bias`` (L, 2F) and ``w2_bias`` (L, D), so that expert l computes
``act(x @ w13[l] + w13_bias[l]) * w @ w2[l] + w * w2_bias[l]`` (the routing weight scales the
whole expert output, its down bias too); ``act`` SwiGLU, the clamped SwiGLU
(:func:`~moetrain.model.clamped_swiglu.clamped_swiglu_packed`) or the squared ReLU of an up
projection alone (``relu2``: ``w13`` (L, D, F), not gated), as ``moe.activation`` says. With
``score_on_input`` (``moe.score_on_input``, Llama 4) the routing weight scales the row's input
instead, and expert l computes the unweighted ``act((w * x) @ w13[l] + w13_bias[l]) @ w2[l] +
w2_bias[l]`` (``w`` cast to the rows' dtype first, as transformers' Llama 4 does). Packing w1 and
w3 makes the first projection one (N, D) x (D, 2F) grouped GEMM forward and backward, and its
input gradient one GEMM instead of two plus a sum. Weighting inside the activation (as
Megatron-Core does) means the combine only sums, and keeps no (N, D) expert output for the
weights' gradient.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import nn

from moetrain.model import cpu_matmul
from moetrain.model.clamped_swiglu import clamped_swiglu_packed
from moetrain.model.layers import geglu_packed, relu2_packed, silu_mul_packed
from moetrain.model.moe.gemm_guard import grouped_mm_refusal_for

EXPERT_WEIGHTS = ("w13", "w2")
"""Parameter names of :class:`GroupedExperts` (stacked over local experts in dim 0)."""
EXPERT_BIASES = ("w13_bias", "w2_bias")
"""Its bias parameters with ``moe.expert_biases`` (stacked likewise)."""


def expert_param_names(expert_biases: bool) -> tuple[str, ...]:
    """The stacked parameters of an MoE layer's experts: the weights, and the biases when
    ``moe.expert_biases``."""
    return EXPERT_WEIGHTS + (EXPERT_BIASES if expert_biases else ())


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``F.grouped_mm``'s CPU backward fails on an expanded stride-0 gradient (e.g. straight
    after ``.sum()``), torch 2.13.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.contiguous()


def _expert_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """``a @ b`` for one expert (``offs`` None) or one grouped GEMM over experts (``offs``)."""
    return cpu_matmul.mm(a, b) if offs is None else cpu_matmul.grouped_mm(a, b, offs)


class _DownProjection(torch.autograd.Function):
    """``act @ w2`` per expert, where ``act = silu_mul_packed(h, w)``, saving ``h`` and ``w``
    (which the SwiGLU saves anyway) instead of ``act``: backward recomputes ``act`` (one
    elementwise pass), so a routed copy keeps 2F activations instead of 3F (Megatron-Core's
    ``moe_act`` recompute). A separate autograd node from the SwiGLU, so the engine frees this
    node's (N, D) incoming gradient before the SwiGLU's (N, 2F) one is allocated. ``offs_L``
    given: one grouped GEMM over experts (``w2`` (L, F, D)); None: one expert (``w2`` (F, D))."""

    @staticmethod
    def forward(ctx, act, h, w, w2, offs, act_fn):  # noqa: ANN001, ANN205
        ctx.save_for_backward(h, w, w2, offs)
        ctx.act_fn = act_fn
        return _expert_mm(act, w2, offs)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        h, w, w2, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_act = grad_w2 = None
        if ctx.needs_input_grad[0]:
            grad_act = _expert_mm(grad, w2.transpose(-2, -1), offs)
        if ctx.needs_input_grad[3]:
            with torch.no_grad():
                act = ctx.act_fn(h, w)
            grad_w2 = _expert_mm(act.t(), grad, offs)
        return grad_act, None, None, grad_w2, None, None


Activation = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _swiglu_down(
    h: torch.Tensor,
    w: torch.Tensor | None,
    w2: torch.Tensor,
    offs: torch.Tensor | None,
    recompute: bool,
    act_fn: Activation = silu_mul_packed,
) -> torch.Tensor:
    """``act_fn(h, w) @ w2`` (per expert with ``offs``); ``recompute``: the activation is not
    kept for backward."""
    act = act_fn(h, w)
    if recompute:
        return _DownProjection.apply(act, h, w, w2, offs, act_fn)
    return act @ w2 if offs is None else _gmm(act, w2, offs)


def pack_w13(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """``w1``, ``w3`` (..., D, F) -> ``w13`` (..., D, 2F)."""
    return torch.cat([w1, w3], dim=-1)


def unpack_w13(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13`` (..., D, 2F) -> views ``w1``, ``w3`` (..., D, F)."""
    return w13.chunk(2, dim=-1)


def grouped_mm_supported(x_ND: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` may run the experts on ``x_ND`` with weights ``w13`` (and
    ``w2``): the rules of :mod:`moetrain.model.moe.gemm_guard`. Elsewhere the per-expert loop
    runs."""
    return grouped_mm_refusal_for(x_ND, *weights) is None


def _gmm(x_NI: torch.Tensor, w_LIO: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(cpu_matmul.grouped_mm(x_NI, w_LIO, offs_L))


class GroupedExperts(nn.Module):
    """L SwiGLU experts; ``forward(x_ND, counts_L, weights_N=None) -> y_ND`` (each row's output
    scaled by its routing weight in ``weights_N``).

    ``grouped_mm=True`` uses ``torch.nn.functional.grouped_mm`` (one kernel per weight for all
    experts) where :func:`grouped_mm_supported`; otherwise, or with False, the per-expert loop
    (the reference) runs; ``path`` says which ran last (``grouped_mm`` or ``loop: <why>``), and
    a refusal by the guard on CUDA is warned about.
    Experts with zero tokens and N = 0 are fine: every weight still gets a (zero) gradient.

    ``num_experts`` is always the global count; ``local_experts=(start, stop)`` builds only
    global experts ``[start, stop)`` (an expert-parallel rank never allocates the others;
    ``num_local_experts`` = stop - start). ``recompute_act``:
    the SwiGLU product is recomputed in backward rather than saved (see ``_DownProjection``).
    ``biases``: the ``w13_bias`` / ``w2_bias`` parameters; ``activation`` ``swiglu``,
    ``geglu``, ``clamped_swiglu`` with ``alpha``, ``limit`` and ``up_offset``, or ``relu2``;
    ``score_on_input``: the routing weights
    scale the rows' inputs, not the outputs (see the module docstring).
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        hidden: int,
        grouped_mm: bool = True,
        local_experts: tuple[int, int] | None = None,
        recompute_act: bool = False,
        biases: bool = False,
        activation: str = "swiglu",
        alpha: float | None = None,
        limit: float | None = None,
        score_on_input: bool = False,
        up_offset: float = 1.0,
    ):
        super().__init__()
        start, stop = local_experts or (0, num_experts)
        if not 0 <= start < stop <= num_experts:
            raise ValueError(f"local_experts {local_experts} is not inside 0..{num_experts}")
        self.num_experts = num_experts
        self.local_experts = (start, stop)
        self.num_local_experts = stop - start
        self.use_grouped_mm = grouped_mm
        self.recompute_act = recompute_act
        self.score_on_input = score_on_input
        self.path: str | None = None
        width = hidden if activation == "relu2" else 2 * hidden  # (not gated: up alone)
        self.w13 = nn.Parameter(torch.empty(stop - start, d_model, width))
        self.w2 = nn.Parameter(torch.empty(stop - start, hidden, d_model))
        self.param_names = expert_param_names(biases)
        self.w13_bias = nn.Parameter(torch.empty(stop - start, width)) if biases else None
        self.w2_bias = nn.Parameter(torch.empty(stop - start, d_model)) if biases else None
        self.act_fn: Activation = silu_mul_packed
        if activation == "clamped_swiglu":
            self.act_fn = functools.partial(
                clamped_swiglu_packed, alpha=alpha, limit=limit, offset=up_offset
            )
        elif activation == "geglu":
            self.act_fn = geglu_packed
        elif activation == "relu2":
            self.act_fn = relu2_packed
        elif activation != "swiglu":
            raise ValueError(f"unknown expert activation {activation!r}")

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal(0, std) input projections, Normal(0, out_std) output projection.

        Drawn one global expert at a time (every w13, then every w2) whichever experts this
        module holds, so every expert-parallel layout gets the single-process init; biases
        zero.
        """
        start, stop = self.local_experts
        for w, w_std in ((self.w13, std), (self.w2, out_std)):
            one_expert = torch.empty(w.shape[1:], dtype=w.dtype, device=w.device)
            for e in range(self.num_experts):
                one_expert.normal_(0.0, w_std)
                if start <= e < stop:
                    w[e - start].copy_(one_expert)
        for b in (self.w13_bias, self.w2_bias):
            if b is not None:
                b.zero_()

    def forward(
        self,
        x_ND: torch.Tensor,
        counts_L: torch.Tensor,
        weights_N: torch.Tensor | None = None,
        w13: torch.Tensor | None = None,
        w2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``w13`` (L', D, 2F), ``w2`` (L', F, D): stacked weights to compute with instead of
        this module's (both or neither), one per entry of ``counts_L``."""
        if (w13 is None) != (w2 is None):
            raise ValueError("GroupedExperts: give both w13 and w2, or neither")
        if w13 is None:
            w13, w2 = self.w13, self.w2
        elif self.w13_bias is not None:
            raise ValueError("GroupedExperts: experts with biases compute with their own weights")
        if self.score_on_input and weights_N is not None:  # each copy's input, then unweighted
            x_ND = x_ND * weights_N.to(x_ND.dtype).unsqueeze(-1)
            weights_N = None
        return self._compute(x_ND, counts_L, weights_N, w13, w2)

    def _compute(
        self,
        x_ND: torch.Tensor,
        counts_L: torch.Tensor,
        weights_N: torch.Tensor | None,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        if not self.use_grouped_mm:
            why = "grouped_mm=False"
        elif x_ND.shape[0] == 0:
            why = "no tokens"
        else:
            why = grouped_mm_refusal_for(x_ND, w13, w2)
            if why is None:
                self.path = "grouped_mm"
                return self._forward_grouped(x_ND, counts_L, weights_N, w13, w2)
            if x_ND.is_cuda:
                warnings.warn(f"moetrain experts run one GEMM per expert: {why}", stacklevel=3)
        self.path = f"loop: {why}"
        return self._forward_loop(x_ND, counts_L, weights_N, w13, w2)

    def _forward_grouped(
        self,
        x_ND: torch.Tensor,
        counts_L: torch.Tensor,
        weights_N: torch.Tensor | None,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        offs_L = torch.cumsum(counts_L, 0, dtype=torch.int32)
        h_N2F = _gmm(x_ND, w13.to(x_ND.dtype), offs_L)
        expert_N = None
        if self.w13_bias is not None:  # each row's expert (no host sync: N is known)
            local = torch.arange(counts_L.shape[0], device=x_ND.device)
            expert_N = torch.repeat_interleave(local, counts_L, output_size=x_ND.shape[0])
            h_N2F = h_N2F + self.w13_bias.to(x_ND.dtype).index_select(0, expert_N)
        y_ND = _swiglu_down(
            h_N2F, weights_N, w2.to(x_ND.dtype), offs_L, self.recompute_act, self.act_fn
        )
        if expert_N is not None:
            y_ND = y_ND + _weighted(
                self.w2_bias.to(x_ND.dtype).index_select(0, expert_N), weights_N
            )
        return y_ND

    def _forward_loop(
        self,
        x_ND: torch.Tensor,
        counts_L: torch.Tensor,
        weights_N: torch.Tensor | None,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        # no rows: every count is 0, known without reading them (a host sync on CUDA)
        splits = counts_L.tolist() if x_ND.shape[0] else [0] * counts_L.shape[0]
        xs = torch.split(x_ND, splits)
        ws = [None] * len(xs) if weights_N is None else torch.split(weights_N, splits)
        outs = []
        b13, b2 = self.w13_bias, self.w2_bias
        for i, (x_nD, w_n) in enumerate(zip(xs, ws, strict=True)):
            h_n2F = x_nD @ w13[i].to(x_nD.dtype)
            if b13 is not None:
                h_n2F = h_n2F + b13[i].to(x_nD.dtype)
            w2_i = w2[i].to(x_nD.dtype)
            y_nD = _swiglu_down(h_n2F, w_n, w2_i, None, self.recompute_act, self.act_fn)
            if b2 is not None:
                y_nD = y_nD + _weighted(b2[i].to(x_nD.dtype).expand_as(y_nD), w_n)
            outs.append(y_nD)
        return torch.cat(outs, 0)


def _weighted(b_ND: torch.Tensor, weights_N: torch.Tensor | None) -> torch.Tensor:
    """Each row of a down bias times its routing weight (in the rows' dtype)."""
    return b_ND if weights_N is None else b_ND * weights_N.unsqueeze(-1).to(b_ND.dtype)
