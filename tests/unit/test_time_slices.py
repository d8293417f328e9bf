"""``benchmarks/time_slices.py``: which timed steps of a run let run in slices are counted (only
those inside one slice: no pause within them), read from both sides' own records."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "time_slices.py"
spec = importlib.util.spec_from_file_location("time_slices", SCRIPT)
ts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ts)

SLICES = [(10.0, 15.0), (20.0, 25.0), (30.0, 35.0)]  # the run's turns; stopped in between


def test_only_steps_inside_one_slice_are_kept() -> None:
    timed = [
        (10.0, 12.0, 1),  # from the slice's first instant: kept
        (12.0, 15.0, 1),  # to its last: kept
        (14.0, 21.0, 1),  # across a pause (5 s of it stopped): dropped
        (21.0, 24.0, 1),  # kept
        (24.5, 30.5, 1),  # ends in the next slice: dropped
        (30.5, 36.0, 1),  # past the last slice's end: dropped
        (5.0, 9.0, 1),  # before the first slice: dropped
    ]
    assert ts.kept_seconds(timed, SLICES) == [2.0, 3.0, 3.0]


def test_moetrain_records_skip_the_first_steps_and_cover_their_steps() -> None:
    every_step = [
        {"step": n, "time": 10.0 + n, "step_time_s": 1.0, "tokens_per_s": 1} for n in (1, 2, 3, 4)
    ]
    every_step.insert(2, {"step": 2, "val_loss": 5.0, "time": 12.5})  # evaluation: not timed
    assert ts.moetrain_steps(every_step) == [(12.0, 13.0, 1), (13.0, 14.0, 1)]
    every_other = [{"step": n, "time": 10.0 + 2 * n, "step_time_s": 1.5} for n in (1, 2, 4, 6)]
    stretches = ts.moetrain_steps(every_other)  # step 1 is always logged, then every 2nd
    assert stretches == [(15.0, 18.0, 2), (19.0, 22.0, 2)]
    assert ts.kept_seconds(stretches, [(14.0, 18.5)]) == [1.5]  # per step, not per record


def test_peer_steps_skip_the_first_two() -> None:
    row = {"step_s": 1.0, "step_wall": [[1.0, 2.0], [2.0, 3.0], [3.0, 4.5], [4.5, 5.0]]}
    assert ts.peer_steps(row) == [(3.0, 4.5, 1), (4.5, 5.0, 1)]


def test_steps_after_a_cut_are_not_kept() -> None:
    """The side still running once the other is done: its later steps are left out."""
    cut = ts.until(SLICES, 22.0)
    assert cut == [(10.0, 15.0), (20.0, 22.0)]
    assert ts.kept_seconds([(11.0, 12.0, 1), (20.5, 21.5, 1), (21.0, 23.0, 1)], cut) == [1.0, 1.0]


def test_active_time_and_median() -> None:
    assert ts.active_seconds(SLICES) == 15.0
    assert ts.median_seconds([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(RuntimeError, match="--slice"):
        ts.median_seconds([])
