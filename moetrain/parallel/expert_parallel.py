"""Expert parallelism applied to a model built on one device.

Legend: T tokens on this rank, K top_k, D d_model, E global experts, L local experts
(E / ep_size), P ep_size, N routed copies sent by this rank, M copies received by this rank.

:func:`apply_expert_parallel` (every rank built the model with the same seed, either the full
model or, as the trainer does, only its own experts via ``Transformer(..., local_experts=...)``):
- slices each MoE layer's stacked expert weights to this rank's experts ``[ep_rank*L, +L)``
  when they are still the full set,
- replaces ``layer.dispatcher`` with :class:`AllToAllDispatcher` (when ``ep_size > 1``),
- sets ``router.stats_reducer`` to a no-grad sum over every rank (global-batch statistics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moetrain.model.moe.dispatch import (
    Overlap,
    Routes,
    gather_copies,
    gather_weights,
    inverse_permutation,
    permute_rows,
    sum_copies,
)
from moetrain.model.moe.experts import EXPERT_WEIGHTS
from moetrain.model.moe.router import count_experts
from moetrain.parallel.all_to_all import (
    exchange_counts,
    finish_all_to_all_v,
    start_all_to_all_v,
)
from moetrain.parallel.layout import check_experts_divisible
from moetrain.parallel.topology import Topology


@dataclass
class _A2AContext:
    copy_idx_N: Tensor  # flat (t*K + k) index of each sent copy, in send order
    token_idx_N: Tensor  # token of each sent copy
    inverse_N: Tensor | None  # flat slot -> send row, when no copy was dropped
    perm_M: Tensor  # received (source-major) row -> local (expert-major) order
    inverse_M: Tensor  # the inverse of perm_M
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    top_k: int


class AllToAllDispatcher:
    """Dispatcher that sends each kept token copy to the rank holding its expert.

    ``dispatch(x_TD, ids_TK, keep_TK, weights_TK) -> (x_MD, weights_M, counts_L, ctx)``: rows
    and their routing weights grouped by local expert (expert order), each expert's rows
    ordered by source rank. ``combine(y_MD, ctx) -> y_TD``: the (weighted) results return to
    their tokens and are summed over the kept copies (dropped copies contribute zero).
    Per-expert counts are exchanged first, then the rows and the weights (two all-to-all-v in
    flight together). One host sync per call: the split sizes (which also give the number of
    kept copies when ``keep_TK`` is given; None = dropless). ``overlap`` (either method) runs while the exchanges are in flight, and
    its backward while the reverse exchanges are.
    """

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, group: Any) -> None:
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local = num_experts // ep_size
        self.group = group

    def dispatch(
        self, x_TD: Tensor, routes: Routes, overlap: Overlap = None
    ) -> tuple[Tensor, Tensor, Tensor, Any]:
        ids_TK, keep_TK, weights_TK = routes.ids_TK, routes.keep_TK, routes.weights_TK
        T, K = ids_TK.shape
        P, L, E = self.ep_size, self.num_local, self.num_experts
        flat_ids = ids_TK.reshape(-1)
        bins = E
        if keep_TK is not None:  # dropped copies get the sentinel E: they sort last
            flat_ids, bins = flat_ids.masked_fill(~keep_TK.reshape(-1), E), E + 1
        order = torch.argsort(flat_ids, stable=True)  # flat (t*K + k) slots in send order
        counts_E = count_experts(flat_ids, bins)[:E]
        rows = None
        if keep_TK is None:  # dropless: the rows are known before the split sizes
            rows = self._gather(x_TD, weights_TK, order, T * K, K)

        recv_PL = exchange_counts(counts_E, self.group).view(P, L)
        splits = torch.cat([counts_E.view(P, L).sum(1), recv_PL.sum(1)]).tolist()  # one host sync
        send_splits, recv_splits = splits[:P], splits[P:]
        if rows is None:  # the kept copies are the first sum(send_splits) of the order
            rows = self._gather(x_TD, weights_TK, order[: sum(send_splits)], T * K, K)
        x_ND, w_N, copy_idx, token_idx, inverse = rows
        x_sent = start_all_to_all_v(x_ND, recv_splits, send_splits, self.group)
        w_sent = start_all_to_all_v(w_N, recv_splits, send_splits, self.group)

        # received rows are grouped (source rank, local expert); regroup by local expert
        block = torch.repeat_interleave(
            torch.arange(P * L, device=x_TD.device),
            recv_PL.reshape(-1).to(x_TD.device),
            output_size=sum(recv_splits),
        )
        key = (block % L) * P + torch.div(block, L, rounding_mode="floor")
        perm = torch.argsort(key, stable=True)
        counts_L = recv_PL.sum(0)
        inv = inverse_permutation(perm)
        if overlap is not None:
            overlap()
        x_MD, w_M = finish_all_to_all_v(x_sent), finish_all_to_all_v(w_sent)
        ctx = _A2AContext(copy_idx, token_idx, inverse, perm, inv, send_splits, recv_splits, T, K)
        return permute_rows(x_MD, perm, inv), permute_rows(w_M, perm, inv), counts_L, ctx

    @staticmethod
    def _gather(
        x_TD: Tensor, weights_TK: Tensor, copy_idx: Tensor, slots: int, K: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """Rows and weights of the copies ``copy_idx`` (flat slots, in send order), with each
        copy's token and, when every one of the ``slots`` copies is sent, the inverse order."""
        token_idx = torch.div(copy_idx, K, rounding_mode="floor")
        inverse = inverse_permutation(copy_idx) if copy_idx.numel() == slots else None
        x_ND = gather_copies(x_TD, token_idx, inverse, K)
        w_N = gather_weights(weights_TK, copy_idx, inverse)
        return x_ND, w_N, copy_idx, token_idx, inverse

    def combine(self, y_MD: Tensor, ctx: _A2AContext, overlap: Overlap = None) -> Tensor:
        y_recv = permute_rows(y_MD, ctx.inverse_M, ctx.perm_M)
        y_sent = start_all_to_all_v(y_recv, ctx.send_splits, ctx.recv_splits, self.group)
        if overlap is not None:
            overlap()
        y_ND = finish_all_to_all_v(y_sent)
        return sum_copies(y_ND, ctx.token_idx_N, ctx.inverse_N, ctx.num_tokens, ctx.top_k)


def global_sum_reducer(group: Any = None) -> Callable[[Tensor], Tensor]:
    """A no-grad all-reduce (sum) over ``group`` (default: every rank)."""

    def reduce(t: Tensor) -> Tensor:
        with torch.no_grad():
            out = t.detach().clone()
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    return reduce


def moe_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, layer)`` of every MoE layer (modules with router, dispatcher and experts)."""
    from moetrain.model.moe.layer import MoELayer

    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            yield name, module


def slice_experts(experts: nn.Module, start: int, stop: int) -> None:
    """Keep global experts ``[start, stop)`` of a module holding all of them (stacked weights
    ``w13 (E,D,2F)``, ``w2 (E,F,D)``); ``num_experts`` stays the global count."""
    for wname in EXPERT_WEIGHTS:
        w = getattr(experts, wname)
        sliced = nn.Parameter(w.detach()[start:stop].clone(), requires_grad=w.requires_grad)
        setattr(experts, wname, sliced)
    experts.local_experts = (start, stop)
    experts.num_local_experts = stop - start


def apply_expert_parallel(model: nn.Module, topology: Topology) -> nn.Module:
    """Make a single-device model expert-parallel on ``topology`` (in place; returned).

    Its MoE layers hold either every expert or exactly this rank's ones.
    """
    for _, layer in moe_layers(model):
        experts = layer.experts
        num_experts = experts.num_experts
        check_experts_divisible(num_experts, topology.ep_size)
        start, stop = topology.local_experts(num_experts)
        held = experts.local_experts
        if held == (0, num_experts) and topology.ep_size > 1:
            slice_experts(experts, start, stop)
        elif held not in ((0, num_experts), (start, stop)):
            raise ValueError(
                f"MoE layer holds experts [{held[0]}, {held[1]}) of {num_experts}; EP rank "
                f"{topology.ep_rank} of {topology.ep_size} needs all of them or [{start}, {stop})"
            )
        if topology.ep_size > 1:
            layer.dispatcher = AllToAllDispatcher(
                num_experts, topology.ep_size, topology.ep_rank, topology.ep_group
            )
        if topology.world_size > 1:
            layer.router.stats_reducer = global_sum_reducer()
    return model
