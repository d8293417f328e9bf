"""Expert capacity, the one rule: how many copies an expert keeps and which ones.

Shape legend: T tokens, K top_k, E experts, N copies.

An expert keeps at most ``ceil(capacity_factor * T * K / E)`` of the copies routed to it, where T
counts the tokens of every micro-batch its expert-parallel group routes (at EP=1: the rank's own
micro-batch). It keeps the copies with the highest routing weight; ties go to the earlier copy in
the EP group's order (source rank, then token, then slot), so that one process holding the whole
EP group's tokens and any EP size drop exactly the same (token, expert) pairs. The dispatchers
apply the rule where the expert lives (:mod:`moetrain.model.moe.dispatch`,
:mod:`moetrain.parallel.ep_dispatcher`).
"""

from __future__ import annotations

import math

import torch

from moetrain.model.moe.router import count_experts


def expert_capacity(
    capacity_factor: float, num_tokens: int, top_k: int, num_experts: int
) -> int | None:
    """Copies one expert keeps: ``ceil(capacity_factor * num_tokens * top_k / num_experts)``, or
    None when dropless (``capacity_factor`` 0)."""
    if capacity_factor <= 0:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_keep(
    ids: torch.Tensor, priority: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Keep at most ``capacity`` copies per expert, highest priority first (bool, ``ids``' shape).

    Ties go to the earlier copy in row-major order of ``ids``, so the result is deterministic.
    Two stable sorts (no T x E x C tensor) and no host sync.
    """
    ids_N, prio_N = ids.reshape(-1), priority.reshape(-1)
    by_prio_N = torch.argsort(-prio_N, stable=True)
    order_N = by_prio_N[torch.argsort(ids_N[by_prio_N], stable=True)]
    counts_E = count_experts(ids_N, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_N = torch.arange(ids_N.numel(), device=ids_N.device) - starts_E[ids_N[order_N]]
    keep_N = torch.empty_like(ids_N, dtype=torch.bool)
    keep_N[order_N] = rank_N < capacity
    return keep_N.view_as(ids)
