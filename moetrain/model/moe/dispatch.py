"""Dispatcher: permute token copies so each expert's inputs are contiguous, and back.

Shape legend: T tokens, D d_model, K top_k, E global experts, L local experts, N kept copies.

Contract (``Dispatcher`` protocol):
- ``dispatch(x_TD, routes) -> Dispatched``, :class:`Routes` holding ``ids_TK``, ``weights_TK``
  and ``capacity_factor``; :class:`Dispatched` holds x_ND grouped contiguously by local expert
  in expert order, weights_N each row's routing weight (the experts apply it inside their
  activation, or to the row's input with ``moe.score_on_input``), counts_L int64 copies per
  local expert, ``dropped`` (int64 0-dim tensor) the number of copies this rank's experts
  dropped, and ``w13`` / ``w2``: the stacked expert
  weights to compute with, None for the experts' own (a dispatcher that replicates experts
  hands them the weights of every slot of counts_L). With a capacity factor, the drops follow
  :mod:`moetrain.model.moe.capacity`, decided where the expert lives over every copy sent to it.
- ``Routes.zero_TK`` (zero experts, ``moe.zero_experts``): True for the copies routed to a zero
  expert. Those copies go to no expert: they are not sent, computed or counted against any
  capacity (nor as dropped), and combine adds nothing for them (the MoE layer adds their
  identity output itself).
- ``combine(y_ND, dispatched) -> y_TD``: the sum of each token's kept (already weighted) rows,
  zero for tokens whose copies were all dropped; ``dispatched.back`` is what the dispatcher
  itself keeps for the way back.
- Both take ``overlap``, an optional zero-argument callable: independent work (the shared
  expert) that a communicating dispatcher runs while its exchange is in flight; the local one
  just calls it.
The local dispatcher does one stable sort of the flattened expert ids and a gather. Dropless, the
way back sums each token's K rows (``index_add_`` on CPU, an inverse-permutation gather + sum on
CUDA); with drops, a scatter into (T*K, D) and a sum over K. Forward and backward are
deterministic (no atomics) with no Python loops over tokens, and the way back saves nothing but
indices for backward. Expert counts come from :func:`count_experts` (no host sync); dropless
needs no host sync at all, a capacity factor one (the number of kept copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from moetrain.model.moe.capacity import capacity_keep, expert_capacity
from moetrain.model.moe.router import count_experts

Overlap = Callable[[], None] | None  # independent work to run while an exchange is in flight


@dataclass
class Routes:
    """Where each token's K copies go: experts ``ids_TK`` (int64), routing weights
    ``weights_TK`` (also each copy's priority under a capacity), ``capacity_factor``
    (``moe.capacity_factor``: 0 = dropless), and ``zero_TK`` (bool, or None): the copies routed
    to zero experts, which go nowhere (their ids are ignored)."""

    ids_TK: Tensor
    weights_TK: Tensor
    capacity_factor: float = 0.0
    zero_TK: Tensor | None = None

    def ids_or(self, sentinel: int) -> Tensor:
        """``ids_TK`` with the zero experts' copies set to ``sentinel``."""
        if self.zero_TK is None:
            return self.ids_TK
        return self.ids_TK.masked_fill(self.zero_TK, sentinel)


Back = TypeVar("Back")


@dataclass
class Dispatched(Generic[Back]):
    """What a dispatcher hands the experts (see the module docstring) and, in ``back``, what
    its own ``combine`` needs to send the outputs back."""

    x_ND: Tensor
    weights_N: Tensor
    counts_L: Tensor
    dropped: Tensor
    back: Back
    w13: Tensor | None = None
    w2: Tensor | None = None


class Dispatcher(Protocol):
    """Moves token copies to experts and back; see the module docstring for the contract."""

    def dispatch(
        self, x_TD: Tensor, routes: Routes, overlap: Overlap = None
    ) -> Dispatched[Any]: ...

    def combine(
        self, y_ND: Tensor, dispatched: Dispatched[Any], overlap: Overlap = None
    ) -> Tensor: ...


@dataclass
class PermuteContext:
    """What ``unpermute`` needs: for each kept copy (in expert order) its flat (t * K + k) slot
    and its token (slot // K); when nothing was dropped also the inverse permutation (slot ->
    row of x_ND)."""

    slot_N: torch.Tensor
    num_tokens: int
    top_k: int
    token_N: torch.Tensor
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
    acc = _accumulation_dtype(src_ND)
    if src_ND.is_cuda and inverse_N is not None:
        rows = src_ND.index_select(0, inverse_N).view(num_tokens, k, -1)
        return rows.sum(1, dtype=acc).to(src_ND.dtype)
    out = src_ND.new_zeros(num_tokens, src_ND.shape[-1], dtype=acc)
    return out.index_add_(0, token_N, src_ND.to(acc)).to(src_ND.dtype)


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """Sums over a token's copies run in fp32 (or wider), rounded to ``x``'s dtype once."""
    return torch.promote_types(x.dtype, torch.float32)


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


class _SumCopies(torch.autograd.Function):
    """``y_TD[t] = sum of the rows of y_ND that belong to token t``; backward is one gather."""

    @staticmethod
    def forward(ctx, y_ND, token_N, inverse_N, num_tokens, top_k):  # noqa: ANN001, ANN205
        ctx.save_for_backward(token_N)
        return _sum_copies(y_ND, token_N, inverse_N, num_tokens, top_k)

    @staticmethod
    def backward(ctx, grad_TD):  # noqa: ANN001, ANN205
        (token_N,) = ctx.saved_tensors
        return grad_TD.index_select(0, token_N), None, None, None, None


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


def _sum_slots(src_ND: torch.Tensor, slot_N: torch.Tensor, num_groups: int, width: int) -> Tensor:
    acc = _accumulation_dtype(src_ND)
    if src_ND.is_cuda:  # no atomics: one slot per row (slots are unique), then a sum
        buf = src_ND.new_zeros(num_groups * width, src_ND.shape[-1]).index_copy_(0, slot_N, src_ND)
        return buf.view(num_groups, width, -1).sum(1, dtype=acc).to(src_ND.dtype)
    group_N = torch.div(slot_N, width, rounding_mode="floor")
    out = src_ND.new_zeros(num_groups, src_ND.shape[-1], dtype=acc)
    return out.index_add_(0, group_N, src_ND.to(acc)).to(src_ND.dtype)


class _SumSlots(torch.autograd.Function):
    """:func:`sum_slots`; backward is one gather."""

    @staticmethod
    def forward(ctx, src_ND, slot_N, num_groups, width):  # noqa: ANN001, ANN205
        ctx.save_for_backward(slot_N)
        ctx.width = width
        return _sum_slots(src_ND, slot_N, num_groups, width)

    @staticmethod
    def backward(ctx, grad_GD):  # noqa: ANN001, ANN205
        (slot_N,) = ctx.saved_tensors
        group_N = torch.div(slot_N, ctx.width, rounding_mode="floor")
        return grad_GD.index_select(0, group_N), None, None, None


class _GatherSlots(torch.autograd.Function):
    """:func:`gather_slots`; backward sums each group's rows (:func:`sum_slots`)."""

    @staticmethod
    def forward(ctx, x_GD, slot_N, width):  # noqa: ANN001, ANN205
        ctx.save_for_backward(slot_N)
        ctx.width, ctx.num_groups = width, x_GD.shape[0]
        return x_GD.index_select(0, torch.div(slot_N, width, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: ANN001, ANN205
        (slot_N,) = ctx.saved_tensors
        return _sum_slots(grad_ND.contiguous(), slot_N, ctx.num_groups, ctx.width), None, None


def sum_slots(src_ND: Tensor, slot_N: Tensor, num_groups: int, width: int) -> Tensor:
    """``out[g]`` = the sum of the rows ``r`` of ``src_ND`` with ``slot_N[r] // width == g``
    (zero where none): rows sit in unique slots ``g * width + j``. Deterministic: ``index_add_``
    on CPU, a scatter into the slots and a sum on CUDA."""
    return _SumSlots.apply(src_ND, slot_N, num_groups, width)


def gather_slots(x_GD: Tensor, slot_N: Tensor, width: int) -> Tensor:
    """``x_GD[slot_N // width]``, one row per (unique) slot; backward is :func:`sum_slots`."""
    return _GatherSlots.apply(x_GD, slot_N, width)


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


def gather_weights(
    weights_TK: torch.Tensor, slot_N: torch.Tensor, inverse_N: torch.Tensor | None
) -> torch.Tensor:
    """The routing weight of each row: ``weights_TK.reshape(-1)[slot_N]`` (``inverse_N`` given:
    nothing dropped, so a permutation of the T*K weights)."""
    w_flat = weights_TK.reshape(-1)
    if inverse_N is None:
        return w_flat.index_select(0, slot_N)
    return permute_rows(w_flat, slot_N, inverse_N)


def sum_copies(
    y_ND: torch.Tensor,
    token_N: torch.Tensor,
    inverse_N: torch.Tensor | None,
    num_tokens: int,
    top_k: int,
) -> torch.Tensor:
    """``y_TD[t] = sum of the rows r of y_ND with token_N[r] == t`` (0 for tokens without
    rows); ``inverse_N`` (flat slot t * K + k -> row) when nothing was dropped."""
    return _SumCopies.apply(y_ND, token_N, inverse_N, num_tokens, top_k)


def permute(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    keep_TK: torch.Tensor | None,
    weights_TK: torch.Tensor,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PermuteContext]:
    """Sort kept token copies by expert: returns ``(x_ND, weights_N, counts_E, ctx)``.

    ``keep_TK`` None (dropless): no host sync. Otherwise dropped copies get the sentinel id E,
    so they sort last and are cut off, which needs their number on the host (one sync).
    """
    t, k = ids_TK.shape
    ids_flat = ids_TK.reshape(-1)
    if keep_TK is None:
        slot_N = torch.argsort(ids_flat, stable=True)
        counts_E = count_experts(ids_flat, num_experts)
        all_kept = True
    else:
        ids_flat = ids_flat.masked_fill(~keep_TK.reshape(-1), num_experts)
        slot_N = torch.argsort(ids_flat, stable=True)
        counts_E = count_experts(ids_flat, num_experts + 1)[:num_experts]
        kept = int(counts_E.sum())  # host sync: the number of rows
        all_kept = kept == t * k
        if not all_kept:
            slot_N = slot_N[:kept]
    token_N = torch.div(slot_N, k, rounding_mode="floor")
    inverse_N = inverse_permutation(slot_N) if all_kept else None
    x_ND = gather_copies(x_TD, token_N, inverse_N, k)
    w_N = gather_weights(weights_TK, slot_N, inverse_N)
    return x_ND, w_N, counts_E, PermuteContext(slot_N, t, k, token_N, inverse_N)


def unpermute(y_ND: torch.Tensor, ctx: PermuteContext) -> torch.Tensor:
    """Inverse of :func:`permute`: ``y_TD[t] = sum_k y(copy t, k)`` over the kept copies."""
    if ctx.inverse_N is not None:  # dropless: every token has its K copies
        return sum_copies(y_ND, ctx.token_N, ctx.inverse_N, ctx.num_tokens, ctx.top_k)
    d = y_ND.shape[-1]
    y_slots = y_ND.new_zeros(ctx.num_tokens * ctx.top_k, d).index_copy(0, ctx.slot_N, y_ND)
    return y_slots.view(ctx.num_tokens, ctx.top_k, d).sum(1)


class LocalDispatcher:
    """Single-device dispatcher: all E experts are local (L = E); no communication.

    ``capacity_groups``: the T tokens are that many equal consecutive parts, each deciding
    capacity on its own, as the expert-parallel groups of a data-parallel run do (one process
    reproducing such a run on the whole global batch sets it to world / ep_size).
    """

    def __init__(self, num_experts: int, capacity_groups: int = 1) -> None:
        self.num_experts = num_experts
        self.capacity_groups = capacity_groups

    def dispatch(
        self, x_TD: Tensor, routes: Routes, overlap: Overlap = None
    ) -> Dispatched[PermuteContext]:
        """:meth:`Dispatcher.dispatch` (``overlap`` runs first: there is no exchange)."""
        if overlap is not None:
            overlap()
        r = routes
        keep_TK = None if r.capacity_factor <= 0 else self.capacity_keep(r)
        dropped = torch.zeros((), dtype=torch.int64, device=x_TD.device)
        if keep_TK is not None:
            dropped = (~keep_TK).sum()
        if r.zero_TK is not None:  # zero experts' copies: not sent, not dropped
            routed_TK = ~r.zero_TK
            keep_TK = routed_TK if keep_TK is None else keep_TK & routed_TK
        x_ND, w_N, counts_E, ctx = permute(x_TD, r.ids_TK, keep_TK, r.weights_TK, self.num_experts)
        return Dispatched(x_ND, w_N, counts_E, dropped, ctx)

    def capacity_keep(self, routes: Routes) -> Tensor:
        """``keep_TK``: False for the copies over capacity (:mod:`moetrain.model.moe.capacity`),
        decided in each of the ``capacity_groups`` parts of the tokens; zero experts' copies
        are kept (they take no expert's slot)."""
        ids_TK = routes.ids_TK
        t, k = ids_TK.shape
        g, e = self.capacity_groups, self.num_experts
        if t % g:
            raise ValueError(f"{t} tokens do not split into {g} equal capacity groups")
        capacity = expert_capacity(routes.capacity_factor, t // g, k, e)
        if g > 1:  # expert e of part p is bin p * E + e
            part_T = torch.div(torch.arange(t, device=ids_TK.device), t // g, rounding_mode="floor")
            ids_TK = ids_TK + part_T.unsqueeze(1) * e
        if routes.zero_TK is not None:  # one spare bin for the zero experts' copies
            ids_TK = ids_TK.masked_fill(routes.zero_TK, g * e)
        keep_TK = capacity_keep(ids_TK, routes.weights_TK.detach(), g * e + 1, capacity)
        return keep_TK if routes.zero_TK is None else keep_TK | routes.zero_TK

    def combine(
        self, y_ND: Tensor, dispatched: Dispatched[PermuteContext], overlap: Overlap = None
    ) -> Tensor:
        """:meth:`Dispatcher.combine`."""
        if overlap is not None:
            overlap()
        return unpermute(y_ND, dispatched.back)
