"""The expert-parallel dispatcher: a token's row travels once to each EP rank that holds one of
its experts (not once per expert), and the sum of those experts' outputs once back.

Legend: T tokens on this rank, K top_k, D d_model, E global experts, P ep_size, L local experts
(E / P), J = min(K, P) the most rows one token sends, R rows this rank sends (one per token and
destination rank), S rows it receives, N expert copies it computes.

Dispatch:
1. counts: per destination rank, the copies for each of its experts, the rows, and this rank's
   token count; one all-to-all of (P, L + 2) integers, then the one host sync of the layer (all
   split sizes, the copies per local expert, the EP group's tokens);
2. rows: x of each (destination, token) pair, destination-major then token order, and per row
   its K slots' weights and local expert ids (weight 0 and id -1 for slots on other ranks) in one
   fp32 (R, 2K) tensor: two all-to-all-v in flight together, while ``overlap`` runs;
3. at the destination: the received rows' copies sorted by local expert, each expert's copies in
   the EP group's order (source rank, token, slot). With a capacity factor, the copies over an
   expert's capacity are dropped here, over every copy the EP group sent it
   (:mod:`moetrain.model.moe.capacity`): any EP size drops the same (token, expert) pairs as
   one process holding the EP group's tokens. Dropped copies travelled but are not computed.
Zero experts' copies (``Routes.zero_TK``) take the id E, which no rank holds: they add no row,
no count and no capacity slot, and travel nowhere.
Combine: each received row's kept copies are summed where they were computed (a row whose copies
were all dropped returns zeros), the S rows go back, and each token sums its rows. Sums are
deterministic (:func:`~moetrain.model.moe.dispatch.sum_slots`). The exchanges run in the same
order, with the same graph, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moetrain.model.moe.capacity import capacity_keep, expert_capacity
from moetrain.model.moe.dispatch import Dispatched, Overlap, Routes, gather_slots, sum_slots
from moetrain.model.moe.router import count_experts
from moetrain.parallel.all_to_all import (
    TrafficMeter,
    exchange_counts,
    finish_all_to_all_v,
    start_all_to_all_v,
)
from moetrain.parallel.shadow_experts import (
    gather_counts,
    plan_shadows,
    start_replication,
    virtual_ids,
)


def true_indices(mask: Tensor, count: int) -> Tensor:
    """The indices of the ``count`` True entries of the 1-D ``mask``, in order: ``nonzero``
    without its host sync (``count`` is known) and without a sort."""
    n = mask.numel()
    slot = torch.where(mask, torch.cumsum(mask, 0) - 1, count)  # False -> a spare slot
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    return out.scatter_(0, slot, torch.arange(n, device=mask.device))[:count]


@dataclass
class _Context:
    slot_R: Tensor  # token * J + (the row's index among its token's rows), per sent row
    copy_N: Tensor  # received row * K + slot, per computed copy
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    top_k: int


class AllToAllDispatcher:
    """Sends each token's row to the EP ranks holding its experts; see the module docstring.

    ``dispatch(x_TD, routes) -> Dispatched``: the copies this rank's experts compute, grouped
    by local expert; ``combine(y_ND, dispatched) -> y_TD``. ``nodes``: the
    node of each EP rank (default: one node), for :attr:`traffic`, a
    :class:`~moetrain.parallel.all_to_all.TrafficMeter` of what this rank sends.
    ``max_shadows`` > 0 (dropless routing only): up to that many of each forward's most loaded
    experts are replicated from ``experts`` (the layer's
    :class:`~moetrain.model.moe.experts.GroupedExperts`) onto every EP rank
    (:mod:`moetrain.parallel.shadow_experts`); counts_L then also counts the replicas' copies,
    after the L local experts, and the result's ``w13`` / ``w2`` stack the weights of all of
    them (this rank's, then the replicas'): the experts compute with what they are handed.
    """

    def __init__(
        self,
        num_experts: int,
        ep_size: int,
        ep_rank: int,
        group: Any,
        nodes: list[int] | None = None,
        experts: Any = None,
        max_shadows: int = 0,
    ) -> None:
        if max_shadows and experts is None:
            raise ValueError("shadow experts need the layer's experts to replicate")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local = num_experts // ep_size
        self.group = group
        self.traffic = TrafficMeter(ep_rank, nodes if nodes is not None else [0] * ep_size)
        self.experts, self.max_shadows = experts, max_shadows

    def dispatch(
        self, x_TD: Tensor, routes: Routes, overlap: Overlap = None
    ) -> Dispatched[_Context]:
        P, L, E = self.ep_size, self.num_local, self.num_experts
        ids_TK, weights_TK = routes.ids_or(E), routes.weights_TK  # id E: a zero expert's copy
        T, K = ids_TK.shape
        J, dev = min(K, P), ids_TK.device
        shadows = self._plan_shadows(ids_TK, routes)
        replication = None
        if self._shadowing(routes):  # broadcasts in flight during the exchanges
            replication = start_replication(
                self.experts.w13, self.experts.w2, shadows, self.num_local, self.group, self.traffic
            )
        if shadows:  # the same exchange over L + S slots per rank
            ids_TK = virtual_ids(ids_TK, shadows, L, P, self.ep_rank)
            L, E = L + len(shadows), P * (L + len(shadows))
        dest_TK = torch.div(ids_TK, L, rounding_mode="floor")  # P: nowhere (zero experts)
        used = torch.zeros((P + 1) * T, dtype=torch.bool, device=dev)  # (destination, token)
        used[(dest_TK * T + torch.arange(T, device=dev).unsqueeze(1)).reshape(-1)] = True
        used = used[: P * T]
        used_PT = used.view(P, T)
        rows_P = used_PT.sum(1)
        counts_PL = count_experts(ids_TK, E + 1)[:E].view(P, L)
        send = torch.cat([counts_PL, rows_P[:, None], rows_P.new_full((P, 1), T)], 1)
        recv = exchange_counts(send.reshape(-1), self.group, self.traffic).view(P, L + 2)
        copies_L = recv[:, :L].sum(0)
        sizes = torch.cat([rows_P, recv[:, L], recv[:, L + 1], copies_L]).tolist()  # host sync
        send_splits, recv_splits = sizes[:P], sizes[P : 2 * P]
        group_tokens, num_copies = sum(sizes[2 * P : 3 * P]), sum(sizes[3 * P :])

        # one row per (destination, token) pair, destination-major
        pair_R = true_indices(used, sum(send_splits))
        token_R = pair_R % T
        dest_R = torch.div(pair_R, T, rounding_mode="floor")
        row_of_token_R = (used_PT.cumsum(0) - 1).view(-1)[pair_R]
        slot_R = token_R * J + row_of_token_R
        here_RK = dest_TK.index_select(0, token_R) == dest_R.unsqueeze(1)
        w_RK = weights_TK.index_select(0, token_R) * here_RK
        local_RK = torch.where(here_RK, ids_TK.index_select(0, token_R) % L, -1)
        meta_R2K = torch.cat([w_RK, local_RK.to(w_RK.dtype)], 1)
        x_RD = gather_slots(x_TD, slot_R, J)
        self.traffic.add_rows(send_splits)
        x_sent = start_all_to_all_v(x_RD, recv_splits, send_splits, self.group, self.traffic)
        m_sent = start_all_to_all_v(meta_R2K, recv_splits, send_splits, self.group, self.traffic)
        if overlap is not None:
            overlap()
        x_SD, meta_S2K = finish_all_to_all_v(x_sent), finish_all_to_all_v(m_sent)

        # the received copies, by local expert, each expert's in EP-group order
        w_flat = meta_S2K[:, :K].reshape(-1)
        local_flat = meta_S2K[:, K:].detach().reshape(-1).long()
        local_flat = local_flat.masked_fill(local_flat < 0, L)
        copy_N = torch.argsort(local_flat, stable=True)[:num_copies]
        counts_L = copies_L
        dropped = 0
        capacity = expert_capacity(routes.capacity_factor, group_tokens, K, self.num_experts)
        if capacity is not None:  # same graph on every rank, whether it drops or not
            expert_N = torch.repeat_interleave(
                torch.arange(L, device=dev), copies_L, output_size=num_copies
            )
            keep_N = capacity_keep(expert_N, w_flat.detach()[copy_N], L, capacity)
            kept = sum(min(n, capacity) for n in sizes[3 * P :])
            copy_N = copy_N[true_indices(keep_N, kept)]
            counts_L, dropped = copies_L.clamp(max=capacity), num_copies - kept
        x_ND = gather_slots(x_SD, copy_N, K)
        w_N = w_flat.index_select(0, copy_N)
        out = Dispatched(
            x_ND,
            w_N,
            counts_L,
            torch.full((), dropped, dtype=torch.int64, device=dev),
            _Context(slot_R, copy_N, send_splits, recv_splits, T, K),
        )
        if replication is not None:
            out.w13, out.w2 = replication.finish()
        return out

    def _shadowing(self, routes: Routes) -> bool:
        return self.max_shadows > 0 and routes.capacity_factor <= 0

    def _plan_shadows(self, ids_TK: Tensor, routes: Routes) -> list[int]:
        """This forward's shadowed experts (the same on every EP rank); none when off or when
        a capacity factor drops copies."""
        if not self._shadowing(routes):
            return []
        e = self.num_experts
        counts = gather_counts(count_experts(ids_TK, e + 1)[:e], self.group)
        shadows = plan_shadows(counts, self.num_local, self.max_shadows)
        self.traffic.add_replicas(sum(e // self.num_local != self.ep_rank for e in shadows))
        return shadows

    def combine(
        self, y_ND: Tensor, dispatched: Dispatched[_Context], overlap: Overlap = None
    ) -> Tensor:
        ctx = dispatched.back
        rows_in = sum(ctx.recv_splits)
        y_SD = sum_slots(y_ND, ctx.copy_N, rows_in, ctx.top_k)
        y_sent = start_all_to_all_v(
            y_SD, ctx.send_splits, ctx.recv_splits, self.group, self.traffic
        )
        if overlap is not None:
            overlap()
        y_RD = finish_all_to_all_v(y_sent)
        return sum_slots(y_RD, ctx.slot_R, ctx.num_tokens, min(ctx.top_k, self.ep_size))
