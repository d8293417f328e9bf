"""``train_command.py --sliced``: the sides' runs at once, one side let run at a time.

Each round starts every side's runs (a short and a long one, in turn) at the same time, each
launcher in its own session; the harness lets one side run for ``--slice`` seconds while the
others are stopped (SIGSTOP to the whole process tree, so a waiting side takes no CPU), then
the next, from each run's start to its exit. A side whose runs are done keeps its turn idle, so
the others still run half (a third, ...) of the time. Every side's steps are thus timed under the
same machine conditions, minute by minute, however the machine's speed moves.

Figures per side and round, from the runs' own step times (:mod:`time_slices`): the median of
the steps after the first two that ran inside one slice (no pause within them), the number kept
of those timed; from outside, ``(long - short) x tokens per step / (active(long) -
active(short))`` where a run's active time is the length of its own slices from start to exit
(start-up, model build and the final save cancel out as in the sequential rounds); peak RSS as
there (the sampler reads ``VmHWM`` while a side runs: a stopped process's peak does not move).
Every round's turns and timed steps are appended to ``sliced-rounds.jsonl`` beside the moetrain
runs, to check the figures by.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from launched import Launched
from time_slices import active_seconds, kept_seconds, median_seconds

POLL_S = 0.02  # how often a running side is checked for its exit


def _exited_by(cmd: Launched, deadline: float) -> bool:
    """Wait until ``cmd`` exits or ``deadline`` (``time.time()``) passes; whether it exited."""
    while cmd.proc.poll() is None:
        left = deadline - time.time()
        if left <= 0:
            return False
        time.sleep(min(POLL_S, left))
    return True


def take_turns(
    lengths: dict[str, list[int]], start: Callable[[str, int], Launched], slice_s: float
) -> dict[str, dict[int, dict]]:
    """Run each side's runs of ``lengths`` (side -> steps of each run, in order; ``start``
    launches one), the sides taking turns of ``slice_s`` seconds in the order of ``lengths``.
    Returns side -> steps -> the run's result (:meth:`Launched.wait`) and its ``slices``. On
    any error every run still going is continued and killed before the error goes on."""
    sides, todo = list(lengths), {side: list(runs) for side, runs in lengths.items()}
    going: dict[str, tuple[int, Launched, list[tuple[float, float]]]] = {}
    done: dict[str, dict[int, dict]] = {side: {} for side in sides}
    turn = 0
    try:
        while going or any(todo.values()):
            side, turn = sides[turn % len(sides)], turn + 1
            begin = time.time()  # (before the side is let go: its own times lie after)
            if side in going:
                steps, cmd, slices = going[side]
                cmd.resume()
            elif todo[side]:
                steps, slices = todo[side].pop(0), []
                cmd = start(side, steps)
                going[side] = (steps, cmd, slices)
            else:  # this side is done: its turn passes idle
                time.sleep(slice_s)
                continue
            if _exited_by(cmd, begin + slice_s):
                slices.append((begin, time.time()))
                del going[side]
                done[side][steps] = {"result": cmd.wait(), "slices": slices}
            else:
                cmd.stop()
                slices.append((begin, time.time()))  # (after the stop: its own times lie before)
    except BaseException:
        for _, cmd, _ in going.values():
            cmd.kill()
        raise
    return done


def side_figures(runs: dict[int, dict], short: int, long: int, tokens_per_step: int) -> dict:
    """One side's figures of a round from its runs (:func:`take_turns`, each with its
    ``timed`` steps after the first two added)."""
    kept, timed_n = [], 0
    for run in runs.values():
        timed_n += len(run["timed"])
        kept += kept_seconds(run["timed"], run["slices"])
    active = {steps: active_seconds(run["slices"]) for steps, run in runs.items()}
    return {
        "outside": (long - short) * tokens_per_step / (active[long] - active[short]),
        "inside": tokens_per_step / median_seconds(kept),
        "peak_rss_mib": max(run["result"]["peak_rss_mib"] for run in runs.values()),
        "kept": f"{len(kept)} of {timed_n}",
        "kept_s": kept,
    }
