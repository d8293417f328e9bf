"""A/B of moetrain's training step between two checkouts (before / after a change).

    .venv/bin/python benchmarks/ab_checkouts.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 5]
    .venv/bin/python benchmarks/ab_checkouts.py OLD NEW --case moetrain-ep1 -- --world 1

Each round runs ``benchmarks/train_throughput.py --cases CASE --rounds 1`` (``--case``: the
default ``moetrain``, 2 ranks with EP=2; ``moetrain-ep1`` with ``-- --world 1``, one rank's
step alone, the quieter figure on a loaded machine) once in each
checkout (its own benchmark script and its own ``moetrain`` package, first on ``PYTHONPATH``),
alternating which goes first, so that load from other processes hits both alike. Reported: each
round's tokens/s and peak RSS per rank for both, the paired ratios new / old, their median and
range (``--metric cpu_tokens_per_s``: tokens per CPU second of the busiest rank's step, which
load from other processes moves much less than wall time). Extra arguments after ``--`` go to
train_throughput.py (e.g. ``-- --shape fine``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def run_once(checkout: Path, case: str, extra: list[str]) -> dict[str, float]:
    """tokens_per_s and peak_rss_mib of one round of ``case`` in ``checkout``."""
    cmd = [sys.executable, "benchmarks/train_throughput.py", "--cases", case, "--rounds", "1"]
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [*cmd, *extra], cwd=checkout, env=env, capture_output=True, text=True, check=False
    )
    m = re.search(rf"^round \d+ {re.escape(case)}: (\{{.*\}})$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or m is None:
        raise RuntimeError(
            f"{checkout}: benchmark failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
        )
    return json.loads(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--case", default="moetrain", choices=("moetrain", "moetrain-ep1"))
    ap.add_argument(
        "--metric",
        default="tokens_per_s",
        choices=("tokens_per_s", "cpu_tokens_per_s"),
        help="cpu_tokens_per_s: per CPU second of the busiest rank in its step (the old "
        "checkout's train_throughput.py must report it)",
    )
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    ratios, rss, key = [], [], args.metric
    for rnd in range(args.rounds):
        order = [("old", args.old), ("new", args.new)]
        if rnd % 2:
            order.reverse()
        res = {name: run_once(path.resolve(), args.case, extra) for name, path in order}
        ratio = res["new"][key] / res["old"][key]
        ratios.append(ratio)
        rss.append(res["new"]["peak_rss_mib"] / res["old"]["peak_rss_mib"])
        print(
            f"round {rnd}: old {res['old'][key]:.0f} {key} "
            f"{res['old']['peak_rss_mib']:.0f} MiB, new {res['new'][key]:.0f} {key} "
            f"{res['new']['peak_rss_mib']:.0f} MiB, new/old {ratio:.3f}",
            flush=True,
        )
    print(
        f"{key} new/old: median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} paired rounds); "
        f"peak RSS new/old: median {statistics.median(rss):.3f}"
    )


if __name__ == "__main__":
    main()
