"""DeepSeek-V4's MoE block (router, experts, shared expert: forward and backward) in two
checkouts of moetrain side by side, each against transformers' block on the same inputs.

    .venv/bin/python benchmarks/v4_moe_ab.py OLD_CHECKOUT NEW_CHECKOUT --rounds 6

Each round runs one fresh process per checkout (its own ``moetrain`` first on ``PYTHONPATH``),
alternating which goes first. A process loads both sides of ``v4_step.py`` (the bench-size
source model, one 4 x 256 batch, one thread), captures each side's MoE calls of one training
step (``step_sides.py``) and replays them ``--reps`` times alternating moetrain and peer; it
reports the median CPU ms per step of each. Printed: per round new / old (moetrain's block)
and peer / moetrain in each checkout; medians and ranges over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(reps: int) -> None:
    """One checkout's measurement (run with that checkout first on ``PYTHONPATH``)."""
    sys.path.insert(0, str(HERE))
    import torch
    from step_sides import capture, cpu_ms, load_sides, moetrain_step, peer_step

    import moetrain
    from moetrain.model import cpu_matmul

    torch.set_num_threads(1)
    cpu_matmul.use_cpu_matmul(cpu_matmul.preferred_kernel())  # train.cpu_matmul: auto
    ours, peer, ids = load_sides("deepseek_v4", attn_implementation="eager")
    calls = {
        "moetrain": capture(
            ours, {"moe": [b.ffn for b in ours.layers]}, lambda: moetrain_step(ours, ids)
        )["moe"],
        "peer": capture(
            peer, {"moe": [lay.mlp for lay in peer.model.layers]}, lambda: peer_step(peer, ids)
        )["moe"],
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + 1):
        for name, cs in calls.items():
            ms = sum(cpu_ms(c.run) for c in cs)
            if rep:  # (the first: warm-up)
                times[name].append(ms)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(json.dumps({"moetrain_file": moetrain.__file__, **med}))


def run_once(checkout: Path, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(reps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{checkout}: failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    res = json.loads(lines[-1])
    if not res["moetrain_file"].startswith(str(checkout.resolve())):
        raise RuntimeError(f"{checkout}: imported moetrain from {res['moetrain_file']}")
    return res


def summary(label: str, xs: list[float], unit: str = "x") -> str:
    fmt = "{:.2f}" if unit == "x" else "{:.0f}"
    lo, hi, mid = (fmt.format(v) for v in (min(xs), max(xs), statistics.median(xs)))
    return f"{label}: {mid}{unit} ({lo}-{hi}{unit})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, nargs="?")
    ap.add_argument("new", type=Path, nargs="?")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    if args.old is None or args.new is None:
        ap.error("give the OLD and NEW checkouts")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for rnd in range(args.rounds):
        order = (("old", args.old), ("new", args.new))
        for name, checkout in order if rnd % 2 == 0 else order[::-1]:
            runs[name].append(run_once(checkout, args.reps))
        o, n = runs["old"][-1], runs["new"][-1]
        print(
            f"round {rnd}: moetrain MoE block CPU ms old {o['moetrain']:.0f} (peer "
            f"{o['peer']:.0f}), new {n['moetrain']:.0f} (peer {n['peer']:.0f})",
            flush=True,
        )
    old, new = runs["old"], runs["new"]
    print(f"\nMoE block, CPU ms per step (forward + backward), medians of {args.rounds} rounds")
    for name, rs in runs.items():
        print(summary(f"{name} moetrain", [r["moetrain"] for r in rs], " ms"))
        print(summary(f"{name} peer", [r["peer"] for r in rs], " ms"))
    print(
        summary(
            "old / new (speed-up)",
            [o["moetrain"] / n["moetrain"] for o, n in zip(old, new, strict=True)],
        )
    )
    for name, rs in runs.items():
        print(summary(f"peer / {name} moetrain", [r["peer"] / r["moetrain"] for r in rs]))


if __name__ == "__main__":
    main()
