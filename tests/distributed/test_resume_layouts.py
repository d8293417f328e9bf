"""Resume with the optimizer state through the real DeepSpeed engine on gloo ranks.

The resume and reshard matrices take minutes on 2 cores: they run with ``-m long``. (The default
suite reshards with the optimizer state in test_checkpoint_layouts.py.)

- Same layout, bit for bit: with router jitter (per-rank RNG), the aux-loss-free bias moving
  every step and a capacity factor (drops depend on both), a run stopped after 3 steps, saved,
  rebuilt and resumed logs exactly the uninterrupted run's losses, learning rates and biases at
  ZeRO 0, 1 and 2 and EP 1 and 2.
- Another layout (4 -> 2 ranks, 2 -> 4 ranks, EP 2 -> 1): a run stopped on layout A and resumed
  on layout B, Adam moments and step counts re-partitioned, matches the uninterrupted run on
  layout A within the layout-parity tolerance for 5 more steps. The control resumes with
  ``reset_optimizer`` and must not match: the moments matter over those steps.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.checkpoint_jobs import reshard_source_job, reshard_target_job, resume_job
from tests.helpers.distributed import run_distributed_concurrently

pytestmark = [pytest.mark.slow, pytest.mark.long]

STEPS, STOP = 8, 3  # 5 steps after the resume
RESUME_LAYOUTS = [(1, 0), (2, 1), (2, 2)]  # (ep, zero stage) on 2 ranks: ZeRO 0/1/2, EP 1/2
REL = 1e-5  # the layout-parity tolerance (tests/distributed/test_parity.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The same-layout resumes and the two layout-A references, all at once; then every
    layout-B resume at once."""
    tmp = tmp_path_factory.mktemp("resume-layouts")
    resumed, w4, w2 = run_distributed_concurrently(
        [
            (resume_job, 2, RESUME_LAYOUTS, str(tmp / "same"), 6, STOP),
            (reshard_source_job, 4, 2, 2, str(tmp / "a-w4"), STEPS, STOP),
            (reshard_source_job, 2, 2, 2, str(tmp / "a-w2"), STEPS, STOP),
        ],
        timeout=600,
    )
    on2 = [
        (2, 2, w4[0]["checkpoint"], False),  # 4 -> 2 ranks
        (2, 2, w4[0]["checkpoint"], True),  # the same with the moments reset: the control
        (1, 2, w2[0]["checkpoint"], False),  # EP 2 -> 1
    ]
    on4 = [(2, 2, w2[0]["checkpoint"], False)]  # 2 -> 4 ranks
    b2, b4 = run_distributed_concurrently(
        [
            (reshard_target_job, 2, on2, str(tmp / "b-w2"), STEPS),
            (reshard_target_job, 4, on4, str(tmp / "b-w4"), STEPS),
        ],
        timeout=600,
    )
    return {
        "resumed": resumed,
        "source": {4: w4[0]["records"], 2: w2[0]["records"]},
        "4->2": b2[0][0],
        "4->2 reset": b2[0][1],
        "ep2->1": b2[0][2],
        "2->4": b4[0][0],
        "all_ranks": {"4->2": [r[0] for r in b2], "2->4": [r[0] for r in b4]},
    }


@pytest.mark.parametrize(
    "ep,stage", RESUME_LAYOUTS, ids=[f"ep{e}-zero{s}" for e, s in RESUME_LAYOUTS]
)
def test_resume_is_bit_exact_with_jitter_bias_and_capacity(runs, ep, stage):
    for rank, res in enumerate(runs["resumed"]):
        run = res[f"ep{ep}_zero{stage}"]
        assert run["resumed"] == run["uninterrupted"], f"rank {rank}"
    whole = runs["resumed"][0][f"ep{ep}_zero{stage}"]["uninterrupted"]
    assert whole[STOP]["bias"] != whole[STOP - 1]["bias"], "the bias did not move"


def _rel(a: list[float], b: list[float]) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((ta - tb).abs() / tb.abs()).max())


def _matches(source: list[dict], resumed: list[dict]) -> None:
    want = source[STOP:]
    assert len(resumed) == len(want) == STEPS - STOP
    assert _rel([r["loss"] for r in resumed], [r["loss"] for r in want]) < REL
    assert _rel([r["lr"] for r in resumed], [r["lr"] for r in want]) < 1e-12
    got_bias = torch.tensor([r["bias"] for r in resumed])
    assert torch.allclose(got_bias, torch.tensor([r["bias"] for r in want]), atol=1e-7)


@pytest.mark.parametrize("case,world_a", [("4->2", 4), ("2->4", 2), ("ep2->1", 2)])
def test_reshard_keeps_the_optimizer_state(runs, case, world_a):
    res = runs[case]
    assert res["step"] == STOP and res["consumed"] == STEPS
    _matches(runs["source"][world_a], res["records"])


def test_every_rank_of_the_new_layout_agrees(runs):
    for case, per_rank in runs["all_ranks"].items():
        assert all(r["records"] == per_rank[0]["records"] for r in per_rank), case


def test_control_reset_optimizer_does_not_match(runs):
    """Without the moments the run diverges from layout A by far more than the tolerance, so
    the matches above show the moments were carried over."""
    want = [r["loss"] for r in runs["source"][4][STOP:]]
    got = [r["loss"] for r in runs["4->2 reset"]["records"]]
    assert _rel(got, want) > 100 * REL
