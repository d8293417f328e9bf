"""Shadow experts: under expert parallelism, a step's most loaded experts are replicated for that
forward onto every rank of the EP group, and each rank computes its own tokens' copies of them
instead of sending them to the expert's owner (FasterMoE's shadowing). Routing is unchanged: the
same tokens reach the same experts with the same weights; only where a copy is computed moves,
so training matches the layout without shadows up to the order of floating-point sums.

Per MoE layer and forward, every rank's copies per expert are all-gathered (E integers per rank)
and :func:`plan_shadows` picks, identically on every rank, up to ``parallel.shadow_experts``
experts. The owner broadcasts each one's weights; backward sums every rank's gradient of the
replica into the owner's (:class:`_Replicate`). Each shadow costs one broadcast of its weights
(3·D·F values) forward and one reduce of as many gradient values backward, and saves the
all-to-all rows of the copies that stay where they were routed from.
Dropless routing only: a capacity factor drops copies over every copy an expert receives, which
a shadowed expert never sees in one place (the configuration refuses the combination).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moetrain.parallel.all_to_all import TrafficMeter

MIN_GAIN = 0.05
"""A shadow is taken only if it lowers the heaviest rank's copies by at least this fraction of
a balanced rank's copies (the weights' broadcast and reduce are not free)."""


def plan_shadows(counts_PE: list[list[int]], num_local: int, max_shadows: int) -> list[int]:
    """The global experts to replicate, in the order picked: greedily, while fewer than
    ``max_shadows``, the expert of the heaviest rank (copies it computes; lowest rank on ties)
    whose replication leaves the lowest maximum over ranks, if that is at least
    :data:`MIN_GAIN` of the balanced load below the current maximum.
    ``counts_PE[s][e]``: copies rank ``s`` routes to expert ``e``; expert ``e`` lives on rank
    ``e // num_local``. A replicated expert's copies are computed by the rank they come from."""
    ranks, experts = len(counts_PE), len(counts_PE[0])
    total_E = [sum(row[e] for row in counts_PE) for e in range(experts)]
    load = [sum(total_E[r * num_local : (r + 1) * num_local]) for r in range(ranks)]
    min_gain = MIN_GAIN * sum(load) / ranks
    picked: list[int] = []
    while len(picked) < max_shadows:
        heavy = max(range(ranks), key=lambda r: (load[r], -r))
        best: tuple[int, list[int]] | None = None
        for e in range(heavy * num_local, (heavy + 1) * num_local):
            if e in picked:
                continue
            after = [load[r] + counts_PE[r][e] for r in range(ranks)]
            after[heavy] = load[heavy] - total_E[e] + counts_PE[heavy][e]
            if best is None or max(after) < max(best[1]):
                best = (e, after)
        if best is None or max(load) - max(best[1]) < max(min_gain, 1):
            break
        picked.append(best[0])
        load = best[1]
    return picked


def gather_counts(counts_E: Tensor, group: Any) -> list[list[int]]:
    """Every EP rank's copies per expert, ``[rank][expert]`` (one all-gather, one host sync)."""
    size = dist.get_world_size(group)
    out = counts_E.new_empty(size * counts_E.numel())
    dist.all_gather_single(out, counts_E.contiguous(), group=group)
    return out.view(size, -1).tolist()


def virtual_ids(
    ids_TK: Tensor, shadows: list[int], num_local: int, ep_size: int, me: int
) -> Tensor:
    """Expert ids in the layout with shadows: each rank holds ``num_local + len(shadows)`` slots,
    its experts then the replicas; a copy of a shadowed expert goes to replica ``s`` on its own
    rank (``me``), any other to its owner's slot; the id E (a zero expert's copy, held by no
    rank) stays past every slot."""
    slots = num_local + len(shadows)
    table = [(e // num_local) * slots + e % num_local for e in range(num_local * ep_size)]
    table.append(ep_size * slots)
    for s, e in enumerate(shadows):
        table[e] = me * slots + num_local + s
    return (
        torch.tensor(table, device=ids_TK.device)
        .index_select(0, ids_TK.reshape(-1))
        .view_as(ids_TK)
    )


class _Replicate(torch.autograd.Function):
    """``(w13_L, w2_L) -> (w13_L, w2_L, w13_S, w2_S)``: this rank's weights passed through, and
    the ``shadows``' weights, whose broadcasts from their owners are launched here and waited
    for by :meth:`Replication.finish`; backward reduces each replica's gradient to its owner
    and adds it to the owner's.

    It runs even when a plan is empty, so the expert weights' gradients come from the same
    autograd node in every EP group: DeepSpeed's ZeRO-2 hooks fill their reduce buckets in the
    order gradients become ready, which must be the same on every rank of a data-parallel group
    (EP groups plan their shadows apart)."""

    @staticmethod
    def forward(ctx, w13_L, w2_L, shadows, num_local, group, meter, works):  # noqa: ANN001, ANN205
        me, size = dist.get_rank(group), dist.get_world_size(group)
        ctx.shadows, ctx.num_local, ctx.group, ctx.meter = shadows, num_local, group, meter
        replicas = []
        for w in (w13_L, w2_L):
            out = w.new_empty((len(shadows), *w.shape[1:]))
            for s, e in enumerate(shadows):
                owner, local = divmod(e, num_local)
                if owner == me:
                    out[s] = w[local]
                    if meter is not None:
                        meter.add_bytes([1] * size, w[local].numel() * w.element_size())
                works.append(dist.broadcast(out[s], group=group, group_src=owner, async_op=True))
            replicas.append(out)
        return w13_L.view_as(w13_L), w2_L.view_as(w2_L), *replicas

    @staticmethod
    def backward(ctx, g13, g2, g13_S, g2_S):  # noqa: ANN001, ANN205
        me, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        grads = []
        for own, g_S in ((g13, g13_S), (g2, g2_S)):
            owns_copy = False
            for s, e in enumerate(ctx.shadows):
                owner, local = divmod(e, ctx.num_local)
                part = g_S[s].contiguous()
                if owner != me and ctx.meter is not None:
                    ctx.meter.add_bytes(
                        [int(r == owner) for r in range(size)], part.numel() * part.element_size()
                    )
                dist.reduce(part, group=ctx.group, group_dst=owner)
                if owner == me:
                    if not owns_copy:  # the incoming gradient is not ours to change
                        own, owns_copy = own.clone(), True
                    own[local] += part
            grads.append(own)
        return grads[0], grads[1], None, None, None, None, None


class Replication:
    """The replication of one forward's shadows, started by :func:`start_replication`."""

    def __init__(self, outputs: tuple[Tensor, ...], works: list[Any]) -> None:
        self.outputs, self.works = outputs, works

    def finish(self) -> tuple[Tensor, Tensor]:
        """Wait for the broadcasts -> the stacked weights to compute with, ``(w13, w2)`` of
        (L + S) experts: this rank's L, then the S replicas (this rank's own weights when there
        are none)."""
        for work in self.works:
            work.wait()
        w13, w2, w13_S, w2_S = self.outputs
        if not w13_S.shape[0]:
            return w13, w2
        return torch.cat([w13, w13_S]), torch.cat([w2, w2_S])


def start_replication(
    w13_L: Tensor,
    w2_L: Tensor,
    shadows: list[int],
    num_local: int,
    group: Any,
    meter: TrafficMeter | None = None,
) -> Replication:
    """Launch the broadcasts of ``shadows``' weights (global expert ids) from their owners;
    differentiable into every owner's weights. ``meter`` counts the bytes each rank sends for
    them, forward and backward."""
    works: list[Any] = []
    outputs = _Replicate.apply(w13_L, w2_L, shadows, num_local, group, meter, works)
    return Replication(outputs, works)
