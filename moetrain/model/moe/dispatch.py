"""Dispatcher: permute token copies so each expert's inputs are contiguous, and back.

Shape legend: T tokens, D d_model, K top_k, E global experts, L local experts, N kept copies.

Contract (``Dispatcher`` protocol):
- ``dispatch(x_TD, ids_TK, keep_TK) -> (x_ND, counts_L, ctx)``: x_ND grouped contiguously by
  local expert in expert order, counts_L int64 tokens per local expert.
- ``combine(y_ND, weights_TK, ctx) -> y_TD``: weighted sum over the kept copies of each token,
  zero for dropped ones.
The local dispatcher does one stable sort of the flattened expert ids and a gather; on the way
back a gather by the inverse permutation (dropless) or a scatter into (T*K, D) (with drops),
then a batched (1 x K) @ (K x D) weighted sum. Forward and backward are deterministic (no
atomics; the dropless backward is gathers and a sum over K) with no Python loops over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Dispatcher(Protocol):
    """Moves token copies to experts and back; see the module docstring for the contract."""

    def dispatch(
        self, x_TD: torch.Tensor, ids_TK: torch.Tensor, keep_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_ND: torch.Tensor, weights_TK: torch.Tensor, ctx: Any) -> torch.Tensor: ...


@dataclass
class PermuteContext:
    """What ``unpermute`` needs: for each kept copy (in expert order) its flat (t * K + k) slot;
    when nothing was dropped also the inverse permutation (slot -> row of x_ND)."""

    slot_N: torch.Tensor
    num_tokens: int
    top_k: int
    inverse_N: torch.Tensor | None = None


class _GatherCopies(torch.autograd.Function):
    """Dropless dispatch ``x_TD[slot_N // K]`` whose backward is a gather plus a sum over the K
    copies of each token (no zero fill, no scatter-add)."""

    @staticmethod
    def forward(ctx, x_TD, slot_N, inverse_N, top_k):  # noqa: ANN001, ANN205
        ctx.save_for_backward(inverse_N)
        ctx.top_k = top_k
        return x_TD.index_select(0, torch.div(slot_N, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: ANN001, ANN205
        (inverse_N,) = ctx.saved_tensors
        grad_TKD = grad_ND.index_select(0, inverse_N).view(-1, ctx.top_k, grad_ND.shape[-1])
        return grad_TKD.sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """``x.index_select(0, index)`` for a permutation ``index``; backward gathers with the
    inverse permutation (no zero fill, no scatter)."""

    @staticmethod
    def forward(ctx, x, index, inverse):  # noqa: ANN001, ANN205
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute(
    x_TD: torch.Tensor, ids_TK: torch.Tensor, keep_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, PermuteContext]:
    """Sort kept token copies by expert: returns ``(x_ND, counts_E, ctx)``.

    Dropped copies get the sentinel id E, so they sort last and are cut off.
    """
    t, k = ids_TK.shape
    ids_flat = ids_TK.reshape(-1)
    all_kept = bool(keep_TK.all())
    if not all_kept:
        ids_flat = ids_flat.masked_fill(~keep_TK.reshape(-1), num_experts)
    slot_N = torch.argsort(ids_flat, stable=True)
    counts_E = torch.bincount(ids_flat, minlength=num_experts + 1)[:num_experts]
    if all_kept:
        inverse_N = torch.empty_like(slot_N)
        inverse_N[slot_N] = torch.arange(slot_N.numel(), device=slot_N.device)
        x_ND = _GatherCopies.apply(x_TD, slot_N, inverse_N, k)
        return x_ND, counts_E, PermuteContext(slot_N, t, k, inverse_N)
    slot_N = slot_N[: int(counts_E.sum())]
    x_ND = x_TD.index_select(0, torch.div(slot_N, k, rounding_mode="floor"))
    return x_ND, counts_E, PermuteContext(slot_N, t, k)


def unpermute(y_ND: torch.Tensor, weights_TK: torch.Tensor, ctx: PermuteContext) -> torch.Tensor:
    """Inverse of :func:`permute`: ``y_TD[t] = sum_k weights_TK[t, k] * y(copy t, k)``."""
    d = y_ND.shape[-1]
    if ctx.inverse_N is not None:  # dropless: a pure permutation
        y_slots = _Permute.apply(y_ND, ctx.inverse_N, ctx.slot_N)
    else:
        y_slots = y_ND.new_zeros(ctx.num_tokens * ctx.top_k, d).index_copy(0, ctx.slot_N, y_ND)
    w_T1K = weights_TK.to(y_ND.dtype).unsqueeze(1)
    return torch.bmm(w_T1K, y_slots.view(ctx.num_tokens, ctx.top_k, d)).squeeze(1)


class LocalDispatcher:
    """Single-device dispatcher: all E experts are local (L = E); no communication."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(
        self, x_TD: torch.Tensor, ids_TK: torch.Tensor, keep_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, PermuteContext]:
        return permute(x_TD, ids_TK, keep_TK, self.num_experts)

    def combine(
        self, y_ND: torch.Tensor, weights_TK: torch.Tensor, ctx: PermuteContext
    ) -> torch.Tensor:
        return unpermute(y_ND, weights_TK, ctx)
