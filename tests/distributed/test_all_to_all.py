"""The expert-parallel dispatcher on 2 real gloo ranks against the local dispatcher.

Each rank routes its own tokens; the reference runs the same tokens through the local
dispatcher with all experts. Outputs and the gradients of the input and of the routing weights
must match per rank (a dropped copy's weight gets a zero gradient), and each rank's
expert-weight gradients must equal the sum over ranks of the reference gradients of its experts
(every peer's tokens contribute). Covers dropless routing, capacity drops, an expert that gets
no tokens, and a rank whose copies are all dropped.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.configs import tiny_config
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

T, K, D, F, E = 12, 2, 8, 16, 4


CASES = ("dropless", "capacity", "empty_expert", "all_dropped")


def _case(rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + CASES.index(name))
    x = torch.randn(T, D, generator=g)
    experts = torch.tensor([0, 2, 3]) if name == "empty_expert" else torch.arange(E)
    n = len(experts)
    ids = torch.stack([experts[torch.randperm(n, generator=g)[:K]] for _ in range(T)])
    keep = torch.ones(T, K, dtype=torch.bool)
    if name == "capacity":
        keep = torch.rand(T, K, generator=g) > 0.3
    elif name == "all_dropped" and rank == 1:
        keep = torch.zeros(T, K, dtype=torch.bool)
    return x, ids, keep


def _job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moetrain.model.moe.dispatch import LocalDispatcher, Routes
    from moetrain.model.moe.experts import GroupedExperts
    from moetrain.parallel.expert_parallel import AllToAllDispatcher, slice_experts

    out = {}
    for name in CASES:
        x, ids, keep = _case(rank, name)
        weights = torch.rand(T, K, generator=torch.Generator().manual_seed(rank))
        torch.manual_seed(0)
        full = GroupedExperts(E, D, F, grouped_mm=False)
        for w in (full.w13, full.w2):
            torch.nn.init.normal_(w, 0, 0.3)
        local = GroupedExperts(E, D, F, grouped_mm=True)
        local.load_state_dict(full.state_dict())
        lo, hi = rank * (E // world), (rank + 1) * (E // world)
        slice_experts(local, lo, hi)

        # reference: local dispatcher, all experts
        xr = x.clone().requires_grad_(True)
        wr = weights.clone().requires_grad_(True)
        ld = LocalDispatcher(E)
        x_nd, w_n, counts, ctx = ld.dispatch(xr, Routes(ids, wr, keep))
        y_ref = ld.combine(full(x_nd, counts, w_n), ctx)
        y_ref.pow(2).sum().backward()
        ref_w = full.w13.grad.clone()
        ref_w2 = full.w2.grad.clone()
        dist.all_reduce(ref_w)
        dist.all_reduce(ref_w2)

        # expert parallel
        xe = x.clone().requires_grad_(True)
        we = weights.clone().requires_grad_(True)
        ad = AllToAllDispatcher(E, world, rank, dist.group.WORLD)
        x_md, w_m, counts_l, actx = ad.dispatch(xe, Routes(ids, we, keep))
        y_ep = ad.combine(local(x_md, counts_l, w_m), actx)
        y_ep.pow(2).sum().backward()

        out[name] = {
            "y": (y_ep.detach(), y_ref.detach()),
            "dx": (xe.grad, xr.grad),
            "dweights": (we.grad, wr.grad),
            "dweights_dropped": we.grad[~keep],
            "dw13": (local.w13.grad, ref_w[lo:hi]),
            "dw2": (local.w2.grad, ref_w2[lo:hi]),
            "counts": counts_l.tolist(),
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_job, 2)


@pytest.mark.parametrize("case", CASES)
def test_matches_local_dispatcher(results: list[dict], case: str) -> None:
    for rank, res in enumerate(results):
        r = res[case]
        for key in ("y", "dx", "dweights", "dw13", "dw2"):
            got, want = r[key]
            assert got.shape == want.shape, (rank, key)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{case} {key}")
        assert not r["dweights_dropped"].any(), (rank, case)


def test_counts_cover_every_routed_copy(results: list[dict]) -> None:
    total = sum(sum(res["dropless"]["counts"]) for res in results)
    assert total == 2 * T * K
    # expert 1 (rank 0's second expert) receives nothing from either rank
    assert results[0]["empty_expert"]["counts"][1] == 0
    # rank 1 dropped every copy; rank 0 still receives its own copies
    assert sum(results[1]["all_dropped"]["counts"]) + sum(
        results[0]["all_dropped"]["counts"]
    ) == int(T * K)


def _overlap_job(rank: int, world: int) -> dict:
    """An EP MoE layer with a gated shared expert, with and without the overlap: the same
    values, and the order in which backward reached the exchanges and the shared expert."""
    import torch.distributed as dist

    from moetrain.model.moe.layer import MoELayer
    from moetrain.parallel.expert_parallel import AllToAllDispatcher, slice_experts

    out: dict = {}
    for overlap in (True, False):
        cfg = tiny_config(
            moe__num_experts=E,
            moe__top_k=K,
            moe__expert_hidden=F,
            moe__num_shared_experts=1,
            moe__shared_expert_gate=True,
            moe__shared_expert_overlap=overlap,
        )
        torch.manual_seed(0)
        layer = MoELayer(cfg.moe, D)
        for p in layer.parameters():
            torch.nn.init.normal_(p, 0, 0.3)
        slice_experts(layer.experts, rank * (E // world), (rank + 1) * (E // world))
        layer.dispatcher = AllToAllDispatcher(E, world, rank, dist.group.WORLD)
        x = torch.randn(2, T // 2, D, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_(True)
        y, _ = layer(x)

        # log backward: the exchange nodes, and the shared expert's weight gradients
        order: list[str] = []
        names = {
            layer.shared_expert.w1.weight: "shared_up",
            layer.shared_expert.w2.weight: "shared_down",
        }
        seen, stack = set(), [y.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            kind = type(node).__name__
            if "AllToAllV" in kind:
                label = "launch" if kind.startswith("_Finish") else "wait"
            else:
                label = names.get(getattr(node, "variable", None))
            if label:
                node.register_prehook(lambda _g, label=label, log=order: log.append(label))
            stack.extend(next_fn for next_fn, _ in node.next_functions)
        y.pow(2).sum().backward()
        out[overlap] = {
            "y": y.detach(),
            "grads": [x.grad] + [p.grad.clone() for p in layer.parameters()],
            "order": order,
        }
    return out


@pytest.fixture(scope="module")
def overlap_results() -> list[dict]:
    return run_distributed(_overlap_job, 2)


def test_shared_expert_overlap_changes_no_value(overlap_results: list[dict]) -> None:
    for res in overlap_results:
        on, off = res[True], res[False]
        assert torch.equal(on["y"], off["y"])
        assert len(on["grads"]) == 8
        for got, want in zip(on["grads"], off["grads"], strict=True):
            assert torch.equal(got, want)


def test_shared_expert_backward_runs_while_exchanges_are_in_flight(
    overlap_results: list[dict],
) -> None:
    """Backward: the combine's reverse exchange is launched, the shared down projection runs,
    then it is waited for; the dispatch's two reverse exchanges (rows, weights) likewise
    bracket the shared up projections. Without the overlap the shared expert runs first."""
    for res in overlap_results:
        assert res[True]["order"] == [
            "launch",
            "shared_down",
            "wait",
            "launch",
            "launch",
            "shared_up",
            "wait",
            "wait",
        ]
        assert res[False]["order"] == [
            "shared_down",
            "shared_up",
            "launch",
            "wait",
            "launch",
            "launch",
            "wait",
            "wait",
        ]
