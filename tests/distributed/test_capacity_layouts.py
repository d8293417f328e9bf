"""Capacity does not depend on the layout: on the same tokens, EP=1 (one process), EP=2 and EP=4
(4 real gloo ranks) keep and drop exactly the same (token, expert) pairs.

Every rank builds the same 32 tokens, with skewed routing (drops happen) and weights rounded to
one decimal (ties at the capacity boundary, also between copies of different ranks). EP=1 is the
local dispatcher on all of them; EP=4 splits them over the 4 ranks; EP=2 over ranks {0, 1} and,
as a replica, again over {2, 3}. A row's first feature carries its token's index, so each rank
reads which copies its experts kept.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

T_ALL, K, D, E, CF = 32, 2, 4, 8, 1.0


def _tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T_ALL, D, generator=g)
    x[:, 0] = torch.arange(T_ALL, dtype=torch.float32)  # the token's index travels with it
    popular = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05])
    ids = torch.stack([torch.multinomial(popular, K, generator=g) for _ in range(T_ALL)])
    weights = torch.rand(T_ALL, K, generator=g).round(decimals=1)
    return x, ids, weights


def _kept(x_ND: torch.Tensor, counts_L: torch.Tensor, first_expert: int) -> set[tuple[int, int]]:
    experts = torch.repeat_interleave(torch.arange(len(counts_L)), counts_L) + first_expert
    return {(int(t), int(e)) for t, e in zip(x_ND[:, 0].tolist(), experts.tolist(), strict=True)}


def _job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moetrain.model.moe.dispatch import LocalDispatcher, Routes
    from moetrain.parallel.expert_parallel import AllToAllDispatcher

    x, ids, weights = _tokens()
    out: dict = {}
    d = LocalDispatcher(E).dispatch(x, Routes(ids, weights, CF))
    out["ep1"] = (_kept(d.x_ND, d.counts_L, 0), int(d.dropped))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    for ep, group, ep_rank in [(4, dist.group.WORLD, rank), (2, pairs[rank // 2], rank % 2)]:
        n = T_ALL // ep
        mine = slice(ep_rank * n, (ep_rank + 1) * n)
        dispatcher = AllToAllDispatcher(E, ep, ep_rank, group)
        d = dispatcher.dispatch(x[mine], Routes(ids[mine], weights[mine], CF))
        out[f"ep{ep}"] = (_kept(d.x_ND, d.counts_L, ep_rank * (E // ep)), int(d.dropped))
    return out


def test_ep1_ep2_ep4_drop_the_same_pairs() -> None:
    results = run_distributed(_job, 4)
    _, ids, _ = _tokens()
    routed = {(t, int(e)) for t in range(T_ALL) for e in ids[t]}
    kept1, dropped1 = results[0]["ep1"]
    assert 0 < dropped1 < T_ALL * K and len(kept1) == T_ALL * K - dropped1
    assert kept1 < routed
    for res in results:
        assert res["ep1"] == (kept1, dropped1)
    kept4 = set().union(*(res["ep4"][0] for res in results))
    assert kept4 == kept1
    assert sum(res["ep4"][1] for res in results) == dropped1
    for replica in ((0, 1), (2, 3)):
        kept2 = results[replica[0]]["ep2"][0] | results[replica[1]]["ep2"][0]
        assert kept2 == kept1
        assert sum(results[r]["ep2"][1] for r in replica) == dropped1
