"""Load-balancing scopes on the tiny config: loss and balance after a fixed number of steps.

    .venv/bin/python benchmarks/aux_scopes.py                  # 150 steps per scope, 2 CPU ranks
    .venv/bin/python benchmarks/aux_scopes.py --steps 60 --scopes micro_batch global_batch

Trains ``configs/tiny-cpu.yaml`` (prepared first if its shards are missing) once per
``moe.aux_loss_scope`` with ``torchrun`` on 2 CPU ranks (EP=2, ZeRO-2), micro-batch 4 with 2
accumulation steps (the config's global batch of 16 sequences, so that ``global_batch`` and
``global_micro_batch`` differ), the same seed and data. Reported per scope, from metrics.jsonl:
the training loss (cross-entropy) averaged over the last 3 logged steps, the validation loss
at the end, and the mean over those steps of the worst layer's max/mean expert load and the
layers' mean coefficient of variation. Quality, not speed: one run per scope, no repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny-cpu.yaml"
SCOPES = ["micro_batch", "global_micro_batch", "sequence", "global_batch"]


def run(scope: str, steps: int, work: Path) -> dict[str, float]:
    run_dir = work / scope
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not over the last one's
    launch = "-m torch.distributed.run --standalone --nproc_per_node 2 -m moetrain train"
    cmd = [
        sys.executable,
        *launch.split(),
        CONFIG,
        f"moe.aux_loss_scope={scope}",
        f"train.max_steps={steps}",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        f"train.eval_every={steps}",
        "train.log_every=5",
        "checkpoint.save_every_steps=0",
        "checkpoint.resume=none",
        "logging.wandb.mode=disabled",
        f"run_dir={run_dir}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "ce_loss" in r and "step" in r][-3:]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return {
        "ce_loss": statistics.mean(r["ce_loss"] for r in steps_),
        "val_loss": val[-1],
        "max_over_mean": statistics.mean(r["moe/imbalance_max_over_mean"] for r in steps_),
        "cv": statistics.mean(r["moe/cv_mean"] for r in steps_),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--scopes", nargs="*", default=SCOPES, choices=SCOPES)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-aux-scopes")
    args = ap.parse_args()
    if not (ROOT / "data" / "stdlib-4k").exists():
        subprocess.run([sys.executable, "-m", "moetrain", "prepare", CONFIG], cwd=ROOT, check=True)
    print("| scope | train CE (last 3 logs) | val loss | worst max/mean load | mean CV |")
    print("|---|---:|---:|---:|---:|")
    for scope in args.scopes:
        r = run(scope, args.steps, args.work)
        print(
            f"| `{scope}` | {r['ce_loss']:.4f} | {r['val_loss']:.4f} | "
            f"{r['max_over_mean']:.3f} | {r['cv']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
