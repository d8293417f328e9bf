"""Dispatcher: permute token copies so each expert's inputs are contiguous, and back.

Shape legend: T tokens, D d_model, K top_k, E global experts, L local experts, N kept copies.

Contract (``Dispatcher`` protocol):
- ``dispatch(x_TD, ids_TK, keep_TK) -> (x_ND, counts_L, ctx)``: x_ND grouped contiguously by
  local expert in expert order, counts_L int64 tokens per local expert.
- ``combine(y_ND, weights_TK, ctx) -> y_TD``: weighted sum over the kept copies of each token,
  zero for dropped ones.
The local dispatcher does one stable sort of the flattened expert ids and a gather. Dropless, the
way back weights each row and sums each token's K rows (``index_add_`` on CPU, an inverse-
permutation gather + sum on CUDA); with drops, a scatter into (T*K, D) then a batched
(1 x K) @ (K x D) weighted sum. Forward and backward are deterministic (no atomics) with no
Python loops over tokens.
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
    when nothing was dropped also each row's token (slot // K) and the inverse permutation
    (slot -> row of x_ND)."""

    slot_N: torch.Tensor
    num_tokens: int
    top_k: int
    token_N: torch.Tensor | None = None
    inverse_N: torch.Tensor | None = None


def _sum_copies(
    src_ND: torch.Tensor,
    token_N: torch.Tensor,
    inverse_N: torch.Tensor | None,
    num_tokens: int,
    k: int,
) -> torch.Tensor:
    """``out[t] = sum of the rows of src_ND that belong to token t`` (row r to ``token_N[r]``).

    CPU: one ``index_add_`` (sequential, deterministic, no (T*K, D) temporary). CUDA, where
    ``index_add_`` uses atomics, when every token has its K rows (``inverse_N`` given: row of
    each flat slot t * K + k): a gather by the inverse permutation and a sum over K.
    """
    if src_ND.is_cuda and inverse_N is not None:
        return src_ND.index_select(0, inverse_N).view(num_tokens, k, -1).sum(1)
    out = src_ND.new_zeros(num_tokens, src_ND.shape[-1])
    return out.index_add_(0, token_N, src_ND)


class _GatherCopies(torch.autograd.Function):
    """Dropless dispatch ``x_TD[token_N]``; backward sums the K copies of each token."""

    @staticmethod
    def forward(ctx, x_TD, token_N, inverse_N, top_k):  # noqa: ANN001, ANN205
        ctx.save_for_backward(token_N, inverse_N)
        ctx.num_tokens, ctx.top_k = x_TD.shape[0], top_k
        return x_TD.index_select(0, token_N)

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: ANN001, ANN205
        token_N, inverse_N = ctx.saved_tensors
        grad_TD = _sum_copies(grad_ND.contiguous(), token_N, inverse_N, ctx.num_tokens, ctx.top_k)
        return grad_TD, None, None, None


class _CombineCopies(torch.autograd.Function):
    """Combine ``y_TD[t] = sum_k weights_TK[t, k] * y_ND[row of copy (t, k)]``; row r of y_ND
    is the copy in flat slot ``slot_N[r]`` (t * K + k) of token ``token_N[r]``. ``inverse_N``
    (slot -> row) only when no copy was dropped.

    Saves y_ND and the per-row weights; backward is one gather of the output gradient (reused
    for both inputs' gradients) instead of a (T, K, D) outer product and a permutation.
    """

    @staticmethod
    def forward(ctx, y_ND, weights_TK, slot_N, token_N, inverse_N):  # noqa: ANN001, ANN205
        w_N = weights_TK.reshape(-1).index_select(0, slot_N).to(y_ND.dtype)
        ctx.save_for_backward(y_ND, w_N, slot_N, token_N)
        ctx.weights_shape, ctx.weights_dtype = weights_TK.shape, weights_TK.dtype
        t, k = weights_TK.shape
        return _sum_copies(y_ND * w_N.unsqueeze(1), token_N, inverse_N, t, k)

    @staticmethod
    def backward(ctx, grad_TD):  # noqa: ANN001, ANN205
        y_ND, w_N, slot_N, token_N = ctx.saved_tensors
        grad_ND = grad_TD.index_select(0, token_N)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w_N = torch.bmm(grad_ND.unsqueeze(1), y_ND.unsqueeze(2)).view(-1)
            t, k = ctx.weights_shape
            # dropped copies (fewer rows than slots) get a zero gradient
            new = torch.empty if slot_N.numel() == t * k else torch.zeros
            grad_w = new(t * k, dtype=ctx.weights_dtype, device=grad_w_N.device)
            grad_w[slot_N] = grad_w_N.to(ctx.weights_dtype)
            grad_w = grad_w.view(ctx.weights_shape)
        grad_y = grad_ND.mul_(w_N.unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return grad_y, grad_w, None, None, None


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation of the rows; backward gathers by the inverse permutation
    (autograd's ``index_select`` backward would scatter-add into zeros)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):  # noqa: ANN001, ANN205
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` (``perm`` a permutation of x's rows, ``inverse`` its inverse)."""
    return _PermuteRows.apply(x, perm, inverse)


def gather_copies(
    x_TD: torch.Tensor, token_N: torch.Tensor, inverse_N: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """``x_TD[token_N]``: one row per routed copy. ``inverse_N`` (flat slot -> row) when every
    token has its K copies: backward then sums them without atomics on CUDA."""
    if inverse_N is None:
        return x_TD.index_select(0, token_N)
    return _GatherCopies.apply(x_TD, token_N, inverse_N, top_k)


def combine_copies(
    y_ND: torch.Tensor,
    weights_TK: torch.Tensor,
    slot_N: torch.Tensor,
    token_N: torch.Tensor,
    inverse_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * y_ND[row of copy (t, k)]``, 0 for tokens without
    rows; ``slot_N[r]`` is row r's flat slot t * K + k, ``token_N[r]`` its token (slot // K),
    ``inverse_N`` slot -> row when nothing was dropped."""
    return _CombineCopies.apply(y_ND, weights_TK, slot_N, token_N, inverse_N)


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
        token_N = torch.div(slot_N, k, rounding_mode="floor")
        inverse_N = inverse_permutation(slot_N)
        x_ND = gather_copies(x_TD, token_N, inverse_N, k)
        return x_ND, counts_E, PermuteContext(slot_N, t, k, token_N, inverse_N)
    slot_N = slot_N[: int(counts_E.sum())]
    x_ND = x_TD.index_select(0, torch.div(slot_N, k, rounding_mode="floor"))
    return x_ND, counts_E, PermuteContext(slot_N, t, k)


def unpermute(y_ND: torch.Tensor, weights_TK: torch.Tensor, ctx: PermuteContext) -> torch.Tensor:
    """Inverse of :func:`permute`: ``y_TD[t] = sum_k weights_TK[t, k] * y(copy t, k)``."""
    if ctx.inverse_N is not None:  # dropless: every token has its K copies
        return combine_copies(y_ND, weights_TK, ctx.slot_N, ctx.token_N, ctx.inverse_N)
    d = y_ND.shape[-1]
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
