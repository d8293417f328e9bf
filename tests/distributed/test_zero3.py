"""ZeRO-3 with expert parallelism (``parallel.zero_stage=3``, moetrain/parallel/zero3.py) trains
as ZeRO-2 does: the same losses, global gradient norms (clipping active every step), first-step
gradients (each gathered whole) and aux-loss-free biases, in fp32 and bf16, on the parity tests'
configuration (tests/distributed/parity_jobs.py) with the loss in several chunks.

Default suite, on 2 ranks: dp=2 in fp32 with ``parallel.zero3_persistence_elements=0`` (every
weight partitioned over both ranks, the experts over their expert-data-parallel group; the
default threshold keeps each of this tiny model's weights whole, checked) and dp=1 x ep=2 in
bf16 at the default threshold (each weight kept whole on every rank, DeepSpeed's persistent
path; weights in bf16 with fp32 masters and accumulation: a model left in fp32 would give fp32's losses, 1e-4 away from bf16's by the third
step). With -m long: dp=1 x ep=2 with two MTP modules and with tied embeddings (one parameter in
two modules), and dp=2 x ep=2 on 4 ranks (each expert partitioned over a group of 2), plain and
with activation checkpointing (blocks recomputed in backward, the experts' SwiGLU too).

ZeRO-2 is the reference: test_parity.py proves it equal to one process. Rounding: fp32 runs
partitioned differently reduce in another order (about 1e-7 relative here); ``REL`` is 1e-5.
Negative control: one step of difference (the run a step behind) moves the losses far more
than ``REL`` (checked on the runs themselves). Every stage-3 Trainer runs
``moetrain.parallel.zero3.check_placement`` after the engine starts: these tests fail when a
DeepSpeed version stops partitioning or reducing the experts over their groups.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.checkpoint_jobs import resume_job
from tests.distributed.zero3_jobs import sp_stages_job, stages_job
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS = 3
REL = 1e-5


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-12)


def _check(runs: dict) -> None:
    two, three = runs["zero2"], runs["zero3"]
    assert (two["ds_stage"], three["ds_stage"]) == (2, 3)
    assert not three["ds_moe"]  # experts placed by tag, not as DeepSpeed MoE layers
    _check_training(two, three)


def _check_training(two: dict, three: dict) -> None:
    for what in ("losses", "norms"):
        for step, (a, b) in enumerate(zip(two[what], three[what], strict=True)):
            assert _close(a, b), f"{what}[{step}]: zero2 {a} vs zero3 {b}"
    # negative control: a run one step behind (or a loss off by 1e-5) is told apart
    lag = max(abs(a - b) / abs(a) for a, b in zip(two["losses"], two["losses"][1:], strict=False))
    assert lag > 10 * REL
    assert set(two["grads"]) == set(three["grads"]) and two["grads"]
    for name, g2 in two["grads"].items():
        g3 = three["grads"][name]
        err = float((g3 - g2).norm() / g2.norm().clamp_min(1e-30))
        assert err <= REL, f"{name}: first-step gradient differs by {err:.2e} (relative)"
    assert torch.allclose(torch.tensor(two["biases"]), torch.tensor(three["biases"]), atol=1e-9)


def _check_all(out: list[dict], check=_check) -> None:  # noqa: ANN001
    for rank_out in out:
        for key, runs in rank_out.items():
            try:
                check(runs)
            except AssertionError as err:
                raise AssertionError(f"{key}: {err}") from err


def test_zero3_matches_zero2_on_two_ranks() -> None:
    out = run_distributed(stages_job, 2, [(1, "partitioned"), (2, "bf16")], STEPS, timeout=600)
    _check_all(out)
    for rank_out in out:  # threshold 0: nothing kept whole; the default keeps the tiny ones
        partitioned, default = rank_out["ep1_partitioned"]["zero3"], rank_out["ep2_bf16"]["zero3"]
        assert partitioned["weights"] > 0 and partitioned["kept_whole"] == 0, partitioned
        assert default["kept_whole"] == default["weights"] > 0, default


@pytest.mark.long
def test_zero3_matches_zero2_with_mtp_and_tied_embeddings() -> None:
    _check_all(run_distributed(stages_job, 2, [(2, "mtp"), (2, "tied")], STEPS, timeout=600))


def test_zero3_matches_zero2_with_sequence_parallelism() -> None:
    """sp=2 on 2 ranks (packed documents crossing the slices), plain, with latent attention
    (MLA) and with gpt-oss's pieces (a sliding window crossing the slices, sinks, every bias):
    the dense weights partitioned over the sequence-parallel ranks too."""
    layouts = [(2, 1, None), (2, 1, "mla"), (2, 1, "gptoss")]
    out = run_distributed(sp_stages_job, 2, layouts, timeout=600)
    _check_all(out, lambda runs: _check_training(runs["zero2"], runs["zero3"]))


@pytest.mark.long
def test_zero3_matches_zero2_sp2_ep2() -> None:
    out = run_distributed(sp_stages_job, 4, [(2, 2, None)], timeout=900)
    _check_all(out, lambda runs: _check_training(runs["zero2"], runs["zero3"]))


@pytest.mark.long
def test_zero3_matches_zero2_dp2_ep2() -> None:
    _check_all(run_distributed(stages_job, 4, [(2, "base"), (2, "ckpt")], STEPS, timeout=900))


def test_zero3_resumes_exactly(tmp_path) -> None:
    """Stopped after 2 steps, saved, rebuilt and resumed at ZeRO-3 (dp=1 x ep=2, router jitter,
    a moving bias, a capacity factor): the uninterrupted run's losses, learning rates and biases
    bit for bit. (Another layout: test_zero3_checkpoints.py.)"""
    out = run_distributed(resume_job, 2, [(2, 3)], str(tmp_path), 4, 2, timeout=600)
    for rank_out in out:
        run = rank_out["ep2_zero3"]
        assert run["resumed"] == run["uninterrupted"]
        assert run["uninterrupted"][2]["bias"] != run["uninterrupted"][1]["bias"]
