"""Which of a run's timed steps ran without a pause, when the run was let run only in slices.

``train_command.py --sliced`` runs both sides at once and lets one side run at a time (the
other stopped), taking turns; it records each run's slices as ``(start, end)`` wall-clock times
(``time.time()``: the start taken before the run is let go, the end after it is stopped, so any
time the run itself reads during a slice lies inside that slice's record). A step whose start and
end lie inside one slice ran without a pause; the rest are not counted. Pure functions, no torch.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence

Interval = tuple[float, float]  # (start, end), wall-clock seconds
Timed = tuple[float, float, int]  # (start, end, steps): one or more steps timed together


def within_one(interval: Interval, slices: Sequence[Interval]) -> bool:
    """``interval`` lies inside one of ``slices`` (sorted by start, not overlapping)."""
    i = bisect.bisect_right([s for s, _ in slices], interval[0]) - 1
    return i >= 0 and interval[1] <= slices[i][1] and interval[0] <= interval[1]


def kept_seconds(timed: Iterable[Timed], slices: Sequence[Interval]) -> list[float]:
    """The step time (seconds per step) of each timed stretch that ran inside one slice, in
    step order."""
    return [(end - start) / n for start, end, n in timed if within_one((start, end), slices)]


def until(slices: Iterable[Interval], end: float) -> list[Interval]:
    """``slices`` cut at ``end``: what of them lies before it."""
    return [(start, min(stop, end)) for start, stop in slices if start < end]


def active_seconds(slices: Iterable[Interval]) -> float:
    """How long a run was let run: its slices' total length."""
    return sum(end - start for start, end in slices)


def moetrain_steps(rows: Iterable[dict], skip: int = 2) -> list[Timed]:
    """One stretch per steps-logging record of moetrain's metrics.jsonl after the first
    ``skip`` steps: a record ends at its ``time`` and covers the steps since the previous
    record, ``step_time_s`` each. With ``train.log_every=1`` every step is timed alone."""
    out, last = [], 0
    for row in rows:
        if "step_time_s" not in row:
            continue  # (evaluation records)
        steps = row["step"] - last
        if last >= skip:
            out.append((row["time"] - steps * row["step_time_s"], row["time"], steps))
        last = row["step"]
    return out


def peer_steps(row: dict, skip: int = 2) -> list[Timed]:
    """The peer's steps after the first ``skip`` (``peer_train.py``'s ``step_wall``)."""
    return [(start, end, 1) for start, end in row["step_wall"][skip:]]


def median_seconds(kept: Sequence[float]) -> float:
    """The median kept step time; a clear error where no step was kept."""
    if not kept:
        raise RuntimeError(
            "no step ran inside one slice: make --slice longer than a step takes under this load"
        )
    return statistics.median(kept)
