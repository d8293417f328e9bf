"""``moetrain train`` with each ``train.host_allocator`` mode: peak RSS per rank and speed.

    .venv/bin/python benchmarks/host_allocator.py [--rounds 2] [--steps 60]

The command of ``benchmarks/train_command.py`` (``deepspeed`` launcher, 2 CPU ranks, one thread
each, shape ``bench``, EP 2, ZeRO-2, the same token shards) with evaluation every 20 steps and a
checkpoint every 30, so the heap also sees evaluation and saving. The modes run in turn, the
order rotating each round. Per run: wall time, the run's own last logged tokens/s
(metrics.jsonl), and peak RSS (``VmHWM``, the maximum over ranks); then the medians per mode
and, per round, each mode against ``system`` (glibc's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from train_command import moetrain_cmd, prepare, run, run_dir_of  # noqa: E402
from train_throughput import SHAPES  # noqa: E402

MODES = ("keep", "one_arena", "system")


def last_tokens_per_s(steps: int) -> float:
    lines = (run_dir_of(steps) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "tokens_per_s" in r][-1]["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--docs", type=int, default=4000, help="documents of the built-in corpus")
    args = ap.parse_args()
    cmd_args = argparse.Namespace(shape="bench", ep=2, launcher="deepspeed")
    data = prepare(SHAPES["bench"], args.docs)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    for name in [n for n in env if n.startswith("MALLOC_") or n == "GLIBC_TUNABLES"]:
        del env[name]  # they would override every mode
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    port = 29700
    for rnd in range(args.rounds):
        order = MODES[rnd % len(MODES) :] + MODES[: rnd % len(MODES)]
        for mode in order:
            port += 1
            cmd = moetrain_cmd(cmd_args, data, args.steps, port) + [
                f"train.host_allocator={mode}",
                "train.eval_every=20",
                "train.eval_steps=4",
                "checkpoint.save_every_steps=30",
            ]
            r = run(cmd, env)
            row = {
                "wall_s": round(r["wall_s"], 1),
                "tokens_per_s": round(last_tokens_per_s(args.steps)),
                "peak_rss_mib": round(r["peak_rss_mib"]),
            }
            results[mode].append(row)
            print(f"round {rnd} {mode}: {json.dumps(row)}", flush=True)
    print(f"\n{args.rounds} rounds, {args.steps} steps, eval every 20, a save every 30")
    for mode in MODES:
        rows = results[mode]
        rss = [r["peak_rss_mib"] for r in rows]
        speed = [
            r["tokens_per_s"] / s["tokens_per_s"]
            for r, s in zip(rows, results["system"], strict=True)
        ]
        print(
            f"{mode:10s} peak RSS {statistics.median(rss):.0f} MiB ({min(rss)}-{max(rss)}); "
            f"tokens/s vs system per round {', '.join(f'{x:.2f}x' for x in speed)}"
        )


if __name__ == "__main__":
    main()
