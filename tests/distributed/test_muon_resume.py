"""Muon's state in checkpoints through the real DeepSpeed engine on gloo ranks: exact resume,
resharding that keeps the momentum, and ``--reset-optimizer`` from AdamW's checkpoint.

- Same layout, bit for bit: a run resumed from its checkpoint after 3 steps ends with the
  uninterrupted run's records and weights (ZeRO-2 at EP 2); with -m long also with router
  jitter, a moving aux-loss-free bias and capacity drops at ZeRO 0, 1 and 2, EP 1 and 2.
- Another layout: a run stopped on layout A and resumed on layout B, the momentum (and the
  AdamW moments of the other parameters) re-partitioned, ends with layout A's weights within
  the layout-parity tolerance, 5 steps later: EP 2 -> 1 on 2 ranks by default; with -m long
  4 -> 2 ranks (ZeRO-2, and to ZeRO-0). The control resumes 4 -> 2 with the optimizer reset and
  must not match: the momentum matters over those steps.
- With -m long, a checkpoint of an AdamW run resumes under Muon with ``reset_optimizer``
  (a Muon resume without it is refused: tests/unit/test_optim.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.checkpoint_jobs import reshard_source_job, reshard_target_job, resume_job
from tests.helpers.distributed import run_distributed_concurrently

pytestmark = pytest.mark.slow

MUON = {"optim.name": "muon", "moe.first_k_dense": 1}
ADAMW = {"optim.name": "adamw", "moe.first_k_dense": 1}  # (the same model)
STEPS, STOP = 8, 3
REL = 1e-5


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    long = "long" in (request.config.getoption("markexpr") or "")
    tmp = tmp_path_factory.mktemp("muon-resume")
    first = [(reshard_source_job, 2, 2, 2, str(tmp / "a-w2"), STEPS, STOP, MUON)]
    if long:
        first += [
            (resume_job, 2, [(1, 0), (2, 1), (2, 2)], str(tmp / "same"), 6, STOP, MUON),
            (reshard_source_job, 4, 2, 2, str(tmp / "a-w4"), STEPS, STOP, MUON),
            (reshard_source_job, 2, 2, 2, str(tmp / "adamw"), STEPS, STOP, ADAMW),
        ]
    done = run_distributed_concurrently(first, timeout=900)
    w2 = done[0][0]["checkpoint"]
    out = {"source": {2: done[0]}}
    targets = [(2, 2, w2, False), (1, 2, w2, False)]  # the same layout; EP 2 -> 1
    if long:
        out["resumed"], out["source"][4] = done[1], done[2]
        w4 = done[2][0]["checkpoint"]
        targets += [
            (2, 2, w4, False),  # 4 -> 2 ranks
            (2, 2, w4, True),  # the control: the optimizer reset
            (2, 0, w4, False),  # 4 -> 2 ranks, ZeRO-2 -> 0
            (2, 2, done[3][0]["checkpoint"], True),  # AdamW's checkpoint, Muon from it
        ]
    (b2,) = run_distributed_concurrently(
        [(reshard_target_job, 2, targets, str(tmp / "b-w2"), STEPS, MUON)], timeout=900
    )
    out["targets"] = b2
    return out


def _stack(per_rank: list[dict], name: str) -> torch.Tensor:
    """A weight over every rank: expert stacks concatenated in expert order."""
    if ".experts." not in name:
        return per_rank[0]["weights"][name]
    parts = sorted({r["experts"]: r["weights"][name] for r in per_rank}.items())
    return torch.cat([w for _, w in parts])


def _weights_error(source: list[dict], target: list[dict]) -> float:
    worst = 0.0
    for name in source[0]["weights"]:
        want, got = _stack(source, name), _stack(target, name)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def _target(runs: dict, i: int) -> list[dict]:
    return [rank[i] for rank in runs["targets"]]


def test_resume_on_the_same_layout_is_bit_exact(runs) -> None:
    for source, target in zip(runs["source"][2], _target(runs, 0), strict=True):
        assert target["records"] == source["records"][STOP:]
        for name, want in source["weights"].items():
            assert torch.equal(target["weights"][name], want), name


@pytest.mark.long
def test_resume_is_bit_exact_with_jitter_bias_and_capacity(runs) -> None:
    for rank, res in enumerate(runs["resumed"]):
        for key, run in res.items():
            assert run["resumed"] == run["uninterrupted"], (rank, key)


def test_ep2_to_ep1_keeps_the_momentum(runs) -> None:
    target = _target(runs, 1)
    assert target[0]["step"] == STOP and len(target[0]["records"]) == STEPS - STOP
    assert _weights_error(runs["source"][2], target) < REL


@pytest.mark.long
def test_4_to_2_ranks_keeps_the_momentum(runs) -> None:
    source = runs["source"][4]
    assert _weights_error(source, _target(runs, 2)) < REL
    assert _weights_error(source, _target(runs, 4)) < REL  # and ZeRO-2 -> 0
    # the control: without the momentum the weights end far from layout A's
    assert _weights_error(source, _target(runs, 3)) > 100 * REL


@pytest.mark.long
def test_adamw_checkpoint_resumes_under_muon_with_reset(runs) -> None:
    target = _target(runs, 5)
    assert target[0]["step"] == STOP
    losses = [r["loss"] for r in target[0]["records"]]
    assert len(losses) == STEPS - STOP and all(torch.isfinite(torch.tensor(losses)))
