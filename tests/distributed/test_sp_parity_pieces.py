"""The pieces that change what a rank holds per token, under sequence parallelism through a
real DeepSpeed engine on gloo (``sp_parity_jobs.VARIANTS``): losses, clipped norms, first-step
gradients (dense and expert weights, the hyper-connections'), the dropped copies and the
zero-expert share equal one plain torch process on the whole batch, whose packed documents cross
the ranks' slices (test_sp_parity.py's checks and batch); the selection bias is the same on
every rank.

- default, at sp=2 x ep=2 in one job: DeepSeek-V4's pieces (``dsv4``: two hyper-connection
  streams per token, whose collapse is what the head exchange and the expert all-to-alls carry;
  the first layer hash-routed by each rank's own positions' token ids; sqrt(softplus) scores,
  the clamped SwiGLU) at ZeRO-1, and zero experts with a capacity factor that drops copies
  (``zero_capacity``: the zero experts' copies stay on the rank and take no slot) at ZeRO-2;
- with -m long: ``dsv4`` at sp=2 ZeRO-0 with activation checkpointing (the exchanges and the
  hyper-connections again in backward) and at dp=2 x sp=2 x ep=2 ZeRO-1, zero experts without
  capacity at sp=4 x ep=2 ZeRO-0 (4 ranks: the model's 2 key/value heads repeated to 4).
"""

from __future__ import annotations

import pytest

from tests.distributed.sp_parity_jobs import layout_key, layouts_job
from tests.distributed.test_sp_parity import check_first_step_gradients, check_losses_and_norms
from tests.helpers.distributed import run_distributed_concurrently

pytestmark = pytest.mark.slow

DEFAULT = {2: [(2, 2, 1, "dsv4"), (2, 2, 2, "zero_capacity")]}
LONG = {2: [(2, 1, 0, "dsv4", "ckpt")], 4: [(2, 2, 1, "dsv4"), (4, 2, 0, "zero_experts")]}


def _run(jobs: dict[int, list[tuple]]) -> dict:
    """The world-1 references of the layouts' variants beside the layouts' process groups."""
    variants = tuple(dict.fromkeys(lay[3] for lays in jobs.values() for lay in lays))
    runs = [(layouts_job, 1, [], variants), *((layouts_job, w, lays) for w, lays in jobs.items())]
    reference, *done = run_distributed_concurrently(runs)
    return {"references": reference[0], **dict(zip(jobs, done, strict=True))}


def _check(results: dict, world: int, layout: tuple) -> None:
    reference = results["references"][f"reference_{layout[3]}"]
    one = {1: [{"reference": reference}], world: results[world]}
    check_losses_and_norms(one, world, layout)
    check_first_step_gradients(one, world, layout)
    for rank, res in enumerate(results[world]):
        run = res[layout_key(layout)]
        assert run["biases"] == results[world][0][layout_key(layout)]["biases"], rank
        assert run["dropped"] == reference["dropped"], (rank, run["dropped"])
        assert run["zero_share"] == pytest.approx(reference["zero_share"], rel=1e-9), rank
    if "zero" in layout[3]:  # (not vacuous: copies went to zero experts, and were dropped)
        assert reference["zero_share"] > 0
        assert (reference["dropped"] > 0) == ("capacity" in layout[3])


@pytest.fixture(scope="module")
def results() -> dict:
    return _run(DEFAULT)


@pytest.fixture(scope="module")
def long_results() -> dict:
    return _run(LONG)


def _params(jobs: dict[int, list[tuple]]) -> list:
    return [
        pytest.param(w, la, id=f"w{w}-{layout_key(la)}") for w, las in jobs.items() for la in las
    ]


@pytest.mark.parametrize("world,layout", _params(DEFAULT))
def test_piece_sequence_parallel_matches_reference(results, world: int, layout: tuple) -> None:
    _check(results, world, layout)


@pytest.mark.long
@pytest.mark.parametrize("world,layout", _params(LONG))
def test_piece_sequence_parallel_matches_reference_long(long_results, world, layout) -> None:
    _check(long_results, world, layout)
