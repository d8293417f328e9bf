"""The ``global_batch`` aux-loss scope's relation between gradient accumulation and data
parallelism (docs/MOE.md), with real ranks: two micro-batches accumulated on one
rank against the same two micro-batches on two gloo ranks, one micro-step, through the router's
real all-reduce of expert counts. The gradients differ by exactly the first micro-step's term
with its partial fractions, computed by hand; a per-sequence scope gives the same gradient both
ways.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

LN2, LN4 = math.log(2.0), math.log(4.0)
ROW_A = [0.0, 0.0, LN2, LN4]  # probabilities [1/8, 1/8, 1/4, 1/2], picks experts {2, 3}
ROW_B = [LN4, LN2, 0.0, 0.0]  # probabilities [1/2, 1/4, 1/8, 1/8], picks experts {0, 1}
MICRO = [[ROW_A, ROW_A], [ROW_B, ROW_A]]


def _router(scope: str):  # noqa: ANN202
    from moetrain.config import MoEConfig
    from moetrain.model.moe.router import Router

    r = Router(MoEConfig(num_experts=4, top_k=2, aux_loss_scope=scope), d_model=4)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(4))
    return r.train()


def _job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moetrain.parallel.expert_parallel import global_sum_reducer

    out = {}
    for scope in ("global_batch", "sequence"):
        # data parallelism: micro-batch ``rank`` here, one micro-step, gradients averaged
        r = _router(scope)
        r.stats_reducer = global_sum_reducer()
        r.begin_step()
        r(torch.tensor(MICRO[rank]), num_seqs=1).aux_loss.backward()
        r.end_micro_batch()
        grad = r.gate.weight.grad.clone()
        dist.all_reduce(grad)
        # accumulation: both micro-batches on this rank alone
        acc = _router(scope)
        acc.begin_step()
        for mb in MICRO:
            (acc(torch.tensor(mb), num_seqs=1).aux_loss / len(MICRO)).backward()
            acc.end_micro_batch()
        out[scope] = (grad / world, acc.gate.weight.grad, r.step_counts_E.tolist())
    return out


def test_accumulation_and_data_parallelism_differ_by_the_first_micro_step() -> None:
    results = run_distributed(_job, 2)
    data_parallel, accumulated, counts = results[0]["global_batch"]
    assert counts == [1, 1, 3, 3]  # the step's counts, every rank's micro-batch
    # micro-step 1 saw f_1 = [0, 0, 1/2, 1/2] instead of the step's f = [1, 1, 3, 3] / 8, on
    # two tokens A; (1/A) = 1/2; d/dlogits of E sum_e df_e P_e(A) for one token:
    p = torch.tensor([1 / 8, 1 / 8, 1 / 4, 1 / 2])
    df = torch.tensor([0.0, 0.0, 0.5, 0.5]) - torch.tensor([1.0, 1.0, 3.0, 3.0]) / 8
    dlogit = 4 * (df * p - p * (df * p).sum())
    expected = 0.5 * torch.outer(dlogit, torch.tensor(ROW_A))
    torch.testing.assert_close(accumulated - data_parallel, expected, atol=1e-6, rtol=1e-5)
    assert expected.abs().max() > 1e-2
    for res in results:
        torch.testing.assert_close(res["global_batch"][0], data_parallel)
        dp, acc, _ = res["sequence"]
        torch.testing.assert_close(dp, acc, atol=1e-7, rtol=1e-6)
