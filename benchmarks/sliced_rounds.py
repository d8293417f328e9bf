"""``train_command.py --sliced``: the sides' runs at once, one side let run at a time.

Each round starts every side's runs (a short and a long one, in turn) at the same time, each
launcher in its own session; the harness lets one side run for ``--slice`` seconds while the
others are stopped (SIGSTOP to the whole process tree, so a waiting side takes no CPU), then
the next, from each run's start to its exit. Every side's steps are thus timed under the same
machine conditions, minute by minute, however the machine's speed moves; steps count only until
the first side is done (the others then run on under other conditions, not compared).

Figures per side and round, from the runs' own step times (:mod:`time_slices`): the median of
the steps after the first two that ran inside one slice (no pause within them), the number kept
of those timed; from outside, ``(long - short) x tokens per step / (active(long) -
active(short))`` where a run's active time is the length of its own slices from start to exit
(start-up, model build and the final save are meant to cancel out, as in the sequential
rounds; under load start-up alone varies by more than 16 steps take); peak RSS as there (the
sampler reads ``VmHWM`` while a side runs: a stopped process's peak does not move). Every
round's turns and timed steps are appended to ``sliced-rounds.jsonl`` beside the moetrain runs;
the figures again from it:

    .venv/bin/python benchmarks/sliced_rounds.py runs/bench-command/train_command/sliced-rounds.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from launched import Launched
from time_slices import active_seconds, kept_seconds, median_seconds, until

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
    launches one), the sides taking turns of ``slice_s`` seconds in the order of ``lengths``;
    a side whose runs are done gives up its turns, and the last side left runs on alone.
    Returns side -> steps -> the run's result (:meth:`Launched.wait`) and its ``slices``. On
    any error every run still going is continued and killed before the error goes on."""
    sides, todo = list(lengths), {side: list(runs) for side, runs in lengths.items()}
    going: dict[str, tuple[int, Launched, list[tuple[float, float]]]] = {}
    done: dict[str, dict[int, dict]] = {side: {} for side in sides}
    turn = 0
    try:
        while going or any(todo.values()):
            side, turn = sides[turn % len(sides)], turn + 1
            if side not in going and not todo[side]:
                continue
            alone = not any(s in going or todo[s] for s in sides if s != side)
            begin = time.time()  # (before the side is let go: its own times lie after)
            if side in going:
                steps, cmd, slices = going[side]
                cmd.resume()
            else:
                steps, slices = todo[side].pop(0), []
                cmd = start(side, steps)
                going[side] = (steps, cmd, slices)
            if _exited_by(cmd, math.inf if alone else begin + slice_s):
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


def round_figures(record: dict, short: int, long: int, tokens_per_step: int) -> dict[str, dict]:
    """Every side's figures of a round from its record (side -> run length -> the run's
    ``slices``, ``timed`` steps after the first two and ``peak_rss_mib``). Steps count only up
    to the first side's last exit: after it the others run alone, under other conditions."""
    common_end = min(
        max(end for run in runs.values() for _, end in run["slices"]) for runs in record.values()
    )
    return {
        side: side_figures(
            {int(n): run for n, run in runs.items()}, common_end, short, long, tokens_per_step
        )
        for side, runs in record.items()
    }


def side_figures(
    runs: dict[int, dict], common_end: float, short: int, long: int, tokens_per_step: int
) -> dict:
    """One side's figures of a round (:func:`round_figures`)."""
    kept, timed_n = [], 0
    for run in runs.values():
        timed_n += len(run["timed"])
        kept += kept_seconds(run["timed"], until(run["slices"], common_end))
    active = {steps: active_seconds(run["slices"]) for steps, run in runs.items()}
    return {
        "outside": (long - short) * tokens_per_step / (active[long] - active[short]),
        "inside": tokens_per_step / median_seconds(kept),
        "peak_rss_mib": max(run["peak_rss_mib"] for run in runs.values()),
        "kept": f"{len(kept)} of {timed_n}",
        "kept_s": kept,
    }


def main() -> None:
    """The figures again from a ``sliced-rounds.jsonl`` (moetrain / peer, per round and all
    rounds' kept steps together)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("records", type=Path)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=20)
    ap.add_argument("--tokens-per-step", type=int, default=2048, help="2 ranks x 4 x 256: bench")
    args = ap.parse_args()
    lines = args.records.read_text().splitlines()
    rounds = [
        round_figures(json.loads(x), args.short, args.long, args.tokens_per_step) for x in lines
    ]
    for rnd, res in enumerate(rounds):
        m, p = res["moetrain"], res["peer"]
        print(
            f"round {rnd}: moetrain/peer {m['outside'] / p['outside']:.2f}x tokens/s (inside "
            f"{m['inside'] / p['inside']:.2f}x; kept {m['kept']} / {p['kept']}), peak RSS "
            f"{m['peak_rss_mib'] / p['peak_rss_mib']:.2f}x"
        )
    kept = {side: [t for res in rounds for t in res[side]["kept_s"]] for side in rounds[0]}
    med = {side: statistics.median(times) for side, times in kept.items()}
    print(
        f"all rounds' kept steps: moetrain {med['moetrain']:.3f} s ({len(kept['moetrain'])} "
        f"steps), peer {med['peer']:.3f} s ({len(kept['peer'])}): "
        f"{med['peer'] / med['moetrain']:.2f}x tokens/s"
    )


if __name__ == "__main__":
    main()
