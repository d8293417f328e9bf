"""MiMo-V2-Flash's attention pieces under sequence parallelism (``sp_parity_jobs.VARIANTS
["mimo"]``), with -m long: at sp=2 x ep=2 ZeRO-1 the sliding layer's two key/value heads are
split over the ranks and the full layer's one repeated to both, the narrower value heads cross
the head exchange both ways, the sinks are each rank's heads' and the sliding layer's theta
applies at the slices' global positions. Losses, clipped norms and first-step gradients equal
one plain torch process on the whole batch (test_sp_parity.py's checks)."""

from __future__ import annotations

import pytest

from tests.distributed.sp_parity_jobs import layout_key, layouts_job
from tests.distributed.test_sp_parity import check_first_step_gradients, check_losses_and_norms
from tests.helpers.distributed import run_distributed_concurrently

pytestmark = [pytest.mark.slow, pytest.mark.long]

LAYOUT = (2, 2, 1, "mimo")


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    jobs = [(layouts_job, 1, [], ("mimo",)), (layouts_job, 2, [LAYOUT])]
    reference, layout = run_distributed_concurrently(jobs)
    reference[0]["reference"] = reference[0].pop("reference_mimo")  # (the checks' key)
    return {1: reference, 2: layout}


def test_mimo_attention_sequence_parallel_matches_reference(results) -> None:
    assert layout_key(LAYOUT) in results[2][0]
    check_losses_and_norms(results, 2, LAYOUT)
    check_first_step_gradients(results, 2, LAYOUT)
