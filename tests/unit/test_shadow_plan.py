"""Shadow experts' plan and slot mapping (moetrain.parallel.shadow_experts), and the setting's
rules."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.checks import ConfigError
from moetrain.parallel.shadow_experts import MIN_GAIN, plan_shadows, virtual_ids
from tests.helpers.configs import tiny_config


def _loads(counts: list[list[int]], num_local: int, shadows: list[int]) -> list[int]:
    """Copies each rank computes with ``shadows`` replicated (the plan's own bookkeeping,
    recomputed from scratch)."""
    ranks = len(counts)
    load = [0] * ranks
    for src, row in enumerate(counts):
        for e, n in enumerate(row):
            load[src if e in shadows else e // num_local] += n
    return load


def test_hot_expert_is_shadowed_and_balances_the_ranks() -> None:
    # expert 0 (rank 0's) gets 60 copies from each rank; everything else 10
    counts = [[60, 10, 10, 10], [60, 10, 10, 10]]
    assert _loads(counts, 2, []) == [140, 40]
    assert plan_shadows(counts, 2, 1) == [0]
    assert _loads(counts, 2, [0]) == [80, 100]


def test_plan_stops_when_nothing_gains_enough() -> None:
    balanced = [[10, 10, 10, 10], [10, 10, 10, 10]]
    assert plan_shadows(balanced, 2, 4) == []
    # rank 1 sends y copies to expert 0: a shadow moves them, lowering rank 0's load by y;
    # taken only if y >= MIN_GAIN of the balanced load (about 2 copies here)
    assert MIN_GAIN == 0.05
    assert plan_shadows([[20, 22, 20, 17], [1, 0, 0, 0]], 2, 4) == []  # 43/37 -> 42/38
    assert plan_shadows([[20, 22, 20, 17], [3, 0, 0, 0]], 2, 4) == [0]  # 45/37 -> 42/40
    assert plan_shadows([[0, 0], [0, 0]], 1, 2) == []


def test_greedy_picks_respect_the_limit_and_lower_the_maximum() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ranks, local = 4, 2
        counts = torch.randint(0, 50, (ranks, ranks * local), generator=g)
        counts[:, int(torch.randint(0, ranks * local, (1,), generator=g))] += 200
        rows = counts.tolist()
        before = max(_loads(rows, local, []))
        for limit in (1, 3):
            picked = plan_shadows(rows, local, limit)
            assert len(picked) <= limit and len(set(picked)) == len(picked)
            if picked:
                assert max(_loads(rows, local, picked)) < before
        assert plan_shadows(rows, local, 1) == plan_shadows(rows, local, 3)[:1]


def test_virtual_ids_send_shadowed_copies_to_their_own_rank() -> None:
    ids = torch.tensor([[0, 3], [1, 2], [0, 1]])
    # 2 ranks x 2 experts, expert 0 shadowed: each rank holds 3 slots (2 own, 1 replica)
    assert virtual_ids(ids, [0], 2, 2, me=1).tolist() == [[5, 4], [1, 3], [5, 1]]
    assert virtual_ids(ids, [0], 2, 2, me=0).tolist() == [[2, 4], [1, 3], [2, 1]]
    assert virtual_ids(ids, [], 2, 2, me=0).tolist() == ids.tolist()


def test_setting_is_refused_with_a_capacity_factor() -> None:
    with pytest.raises(ConfigError, match="parallel.shadow_experts"):
        tiny_config(parallel__shadow_experts=1, moe__capacity_factor=1.25).validate()
    with pytest.raises(ConfigError, match="parallel.shadow_experts"):
        tiny_config(parallel__shadow_experts=-1).validate()
    tiny_config(parallel__shadow_experts=2).validate()
