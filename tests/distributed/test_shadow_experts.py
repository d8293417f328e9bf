"""Shadow experts on 2 real gloo ranks against the local dispatcher with every expert.

Expert 0 (rank 0's) is picked by most tokens of both ranks, so rank 0 would compute most
copies; with shadows on, the plan replicates it (and maybe one more) and each rank computes its
own copies of it. Outputs, input and routing-weight gradients, and each rank's expert-weight
gradients (the replicas' summed back into the owner's) must equal the reference's, through the
grouped GEMM and the per-expert loop; fewer rows travel, and the replicas are counted.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

T, K, D, F, E = 24, 2, 8, 16, 4


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    hot = torch.rand(T, generator=g) < 0.8
    ids[hot, 0] = 0
    ids[hot & (ids[:, 1] == 0), 1] = 1 + rank  # no token picks one expert twice
    return x, ids, torch.rand(T, K, generator=g)


def _job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moetrain.model.moe.dispatch import LocalDispatcher, Routes
    from moetrain.model.moe.experts import GroupedExperts
    from moetrain.parallel.expert_parallel import AllToAllDispatcher, slice_experts

    parts = [_tokens(r) for r in range(world)]
    lo, hi = rank * (E // world), (rank + 1) * (E // world)
    out = {}
    for name, shadows, grouped in (("grouped", 2, True), ("loop", 1, False), ("off", 0, True)):
        torch.manual_seed(0)
        full = GroupedExperts(E, D, F, grouped_mm=False)
        for w in (full.w13, full.w2):
            torch.nn.init.normal_(w, 0, 0.3)
        local = GroupedExperts(E, D, F, grouped_mm=grouped)
        local.load_state_dict(full.state_dict())
        slice_experts(local, lo, hi)

        xr = torch.cat([p[0] for p in parts]).requires_grad_(True)
        wr = torch.cat([p[2] for p in parts]).requires_grad_(True)
        ld = LocalDispatcher(E)
        d = ld.dispatch(xr, Routes(torch.cat([p[1] for p in parts]), wr))
        y_ref = ld.combine(full(d.x_ND, d.counts_L, d.weights_N), d)
        y_ref.pow(2).sum().backward()
        mine = slice(rank * T, (rank + 1) * T)

        x, ids, weights = parts[rank]
        xe, we = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        ad = AllToAllDispatcher(
            E, world, rank, dist.group.WORLD, experts=local, max_shadows=shadows
        )
        a = ad.dispatch(xe, Routes(ids, we))
        y_ep = ad.combine(local(a.x_ND, a.counts_L, a.weights_N, a.w13, a.w2), a)
        y_ep.pow(2).sum().backward()
        out[name] = {
            "y": (y_ep.detach(), y_ref.detach()[mine]),
            "dx": (xe.grad, xr.grad[mine]),
            "dweights": (we.grad, wr.grad[mine]),
            "dw13": (local.w13.grad, full.w13.grad[lo:hi]),
            "dw2": (local.w2.grad, full.w2.grad[lo:hi]),
            "counts": a.counts_L.tolist(),
            "path": local.path,
            "traffic": dict(zip(ad.traffic.FIELDS, ad.traffic.take(), strict=True)),
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_job, 2)


@pytest.mark.parametrize("case", ["grouped", "loop", "off"])
def test_shadows_match_local_dispatcher(results: list[dict], case: str) -> None:
    for rank, res in enumerate(results):
        r = res[case]
        for key in ("y", "dx", "dweights", "dw13", "dw2"):
            got, want = r[key]
            assert got.shape == want.shape, (rank, key)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{case} {key}")
    assert results[0]["grouped"]["path"] == "grouped_mm"
    assert results[0]["loop"]["path"].startswith("loop")


def test_hot_expert_is_computed_where_its_copies_come_from(results: list[dict]) -> None:
    for res in results:
        off, on = res["off"], res["grouped"]
        assert len(off["counts"]) == E // 2
        assert len(on["counts"]) > E // 2  # this rank's experts, then the replicas
        assert sum(on["counts"]) != sum(off["counts"])  # the work moved between the ranks
        assert on["traffic"]["rows_off_rank"] < off["traffic"]["rows_off_rank"]
        assert off["traffic"]["replicas"] == 0
    # rank 1 received expert 0's weights; every copy is computed exactly once
    assert results[1]["grouped"]["traffic"]["replicas"] >= 1
    assert results[1]["loop"]["traffic"]["replicas"] == 1
    assert sum(sum(r["grouped"]["counts"]) for r in results) == 2 * T * K
    heavy = [max(sum(r[c]["counts"]) for r in results) for c in ("off", "grouped")]
    assert heavy[1] < heavy[0]
