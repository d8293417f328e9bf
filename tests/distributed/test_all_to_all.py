"""The expert-parallel dispatcher on 2 real gloo ranks against the local dispatcher.

Each rank routes its own tokens; the reference runs the EP group's tokens (both ranks') through
the local dispatcher with all experts, capacity decided over all of them. Each rank's outputs and
the gradients of its input and routing weights must equal its part of the reference's (a dropped
copy's weight gets a zero gradient), and each rank's expert-weight gradients the reference's
gradients of its experts. Covers dropless routing, capacity drops with tied weights, an expert
that gets no tokens, and a rank whose copies are all dropped (the other rank's weights win every
slot). Rows travel once per token and destination rank: the traffic counted is checked against
the routes.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.configs import tiny_config
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

T, K, D, F, E = 12, 2, 8, 16, 4

CASES = {"dropless": 0.0, "capacity": 0.75, "empty_expert": 0.0, "all_dropped": 0.5}


def _case(rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens, expert ids and routing weights."""
    g = torch.Generator().manual_seed(100 * rank + list(CASES).index(name))
    x = torch.randn(T, D, generator=g)
    experts = torch.tensor([0, 2, 3]) if name == "empty_expert" else torch.arange(E)
    n = len(experts)
    ids = torch.stack([experts[torch.randperm(n, generator=g)[:K]] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    if name == "capacity":
        weights = weights.round(decimals=1)  # ties between and within ranks
    elif name == "all_dropped":  # rank 0's copies outweigh every copy of rank 1
        weights = weights * 0.1 + (0.8 if rank == 0 else 0.0)
        ids = ids % 2  # both ranks compete for experts 0 and 1 (capacity 6 each, 24 copies)
        ids[:, 1] = 1 - ids[:, 0]
    return x, ids, weights


def _job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moetrain.model.moe.dispatch import LocalDispatcher, Routes
    from moetrain.model.moe.experts import GroupedExperts
    from moetrain.parallel.expert_parallel import AllToAllDispatcher, slice_experts

    out = {}
    for name, cf in CASES.items():
        parts = [_case(r, name) for r in range(world)]
        torch.manual_seed(0)
        full = GroupedExperts(E, D, F, grouped_mm=False)
        for w in (full.w13, full.w2):
            torch.nn.init.normal_(w, 0, 0.3)
        local = GroupedExperts(E, D, F, grouped_mm=True)
        local.load_state_dict(full.state_dict())
        lo, hi = rank * (E // world), (rank + 1) * (E // world)
        slice_experts(local, lo, hi)

        # reference: the EP group's tokens through the local dispatcher, all experts
        xr = torch.cat([p[0] for p in parts]).requires_grad_(True)
        wr = torch.cat([p[2] for p in parts]).requires_grad_(True)
        ids_all = torch.cat([p[1] for p in parts])
        ld = LocalDispatcher(E)
        d = ld.dispatch(xr, Routes(ids_all, wr, cf))
        y_ref = ld.combine(full(d.x_ND, d.counts_L, d.weights_N), d)
        y_ref.pow(2).sum().backward()
        mine = slice(rank * T, (rank + 1) * T)

        # expert parallel
        x, ids, weights = parts[rank]
        xe = x.clone().requires_grad_(True)
        we = weights.clone().requires_grad_(True)
        ad = AllToAllDispatcher(E, world, rank, dist.group.WORLD, nodes=list(range(world)))
        a = ad.dispatch(xe, Routes(ids, we, cf))
        y_ep = ad.combine(local(a.x_ND, a.counts_L, a.weights_N), a)
        y_ep.pow(2).sum().backward()

        keep = ld.capacity_keep(Routes(ids_all, wr, cf))[mine] if cf else None
        out[name] = {
            "y": (y_ep.detach(), y_ref.detach()[mine]),
            "dx": (xe.grad, xr.grad[mine]),
            "dweights": (we.grad, wr.grad[mine]),
            "dweights_dropped": None if keep is None else we.grad[~keep],
            "dw13": (local.w13.grad, full.w13.grad[lo:hi]),
            "dw2": (local.w2.grad, full.w2.grad[lo:hi]),
            "counts": a.counts_L.tolist(),
            "dropped": (int(a.dropped), int(d.dropped)),
            "kept_of_mine": None if keep is None else int(keep.sum()),
            "traffic": ad.traffic.take(),
            "routes": ids,
        }
        if name == "dropless":  # the same under activation checkpointing: forward runs twice
            from torch.utils.checkpoint import checkpoint

            def block(x_TD, w_TK, ad=ad, local=local, ids=ids, cf=cf):  # noqa: ANN001, ANN202
                a = ad.dispatch(x_TD, Routes(ids, w_TK, cf))
                return ad.combine(local(a.x_ND, a.counts_L, a.weights_N), a)

            xc, wc = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
            local.zero_grad()
            checkpoint(block, xc, wc, use_reentrant=False).pow(2).sum().backward()
            ad.traffic.end_micro_batch()
            out["checkpointed"] = {"dx": (xc.grad, xe.grad), "traffic": ad.traffic.take()}
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
        if r["dweights_dropped"] is not None:
            assert not r["dweights_dropped"].any(), (rank, case)


def test_activation_checkpointing_counts_each_dispatch_once(results: list[dict]) -> None:
    """The recomputed forward sends its exchanges again (bytes count twice over the forward's
    part), but its rows and replicas are the same dispatch: counted once."""
    from moetrain.parallel.all_to_all import TrafficMeter

    fields = TrafficMeter.FIELDS
    for res in results:
        got, want = res["checkpointed"]["dx"]
        torch.testing.assert_close(got, want)
        ckpt = dict(zip(fields, res["checkpointed"]["traffic"], strict=True))
        plain = dict(zip(fields, res["dropless"]["traffic"], strict=True))
        for key in TrafficMeter.PER_DISPATCH:
            assert ckpt[key] == plain[key], key
        assert plain["rows_off_rank"] > 0
        assert plain["bytes_off_rank"] < ckpt["bytes_off_rank"] < 2 * plain["bytes_off_rank"]


def test_counts_drops_and_traffic(results: list[dict]) -> None:
    total = sum(sum(res["dropless"]["counts"]) for res in results)
    assert total == 2 * T * K
    # expert 1 (rank 0's second expert) receives nothing from either rank
    assert results[0]["empty_expert"]["counts"][1] == 0
    for case in ("capacity", "all_dropped"):
        # drops counted where the experts live add up to the reference's
        assert sum(res[case]["dropped"][0] for res in results) == results[0][case]["dropped"][1]
        assert results[0][case]["dropped"][1] > 0
    assert results[1]["all_dropped"]["kept_of_mine"] == 0  # rank 1 lost every slot
    assert results[0]["all_dropped"]["kept_of_mine"] > 0

    # one row per token and destination rank (ranks on separate nodes here); bytes: the counts
    # exchange, rows (D floats) and their 2K slot values out, results (D floats) back; in
    # backward the same exchanges in reverse
    def rows(r: int, p: int) -> int:
        dest = torch.div(results[r]["dropless"]["routes"], E // 2, rounding_mode="floor")
        return int((dest == p).any(1).sum())

    for rank, res in enumerate(results):
        sent, received = rows(rank, 1 - rank), rows(1 - rank, rank)
        moved = (sent + received) * 4 * (2 * D + 2 * K) + (E // 2 + 2) * 8
        total = rows(rank, 0) + rows(rank, 1)
        assert res["dropless"]["traffic"] == [total, sent, sent, moved, moved, 0]  # no replicas
        assert total < T * K  # some tokens have both experts on one rank


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
