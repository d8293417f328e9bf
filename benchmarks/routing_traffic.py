"""Group-limited routing: step time and expert all-to-all traffic with and without it.

    .venv/bin/python benchmarks/routing_traffic.py                    # EP=2 and EP=4, shape fine
    .venv/bin/python benchmarks/routing_traffic.py --shape bench --eps 2 --rounds 2

moetrain's Trainer on ``ep`` CPU ranks (gloo, one thread each, EP = world, ZeRO-2) at a shape
of ``benchmarks/train_throughput.py`` (default ``fine``: 64 experts, top-8, expert hidden 128).
Cases: ``plain`` top-k routing, and ``grouped``: ``moe.n_group = ep`` (one expert group per EP
rank), ``moe.topk_group = 1``, so that all of a token's copies go to one rank. Per case: median
step time over ``--steps`` steps after ``--warmup``, and from the step records (summed over
ranks and MoE layers, per step): rows dispatched (one per token and destination rank), rows to
other ranks, bytes to other ranks (every expert all-to-all, forward and backward). The two cases
alternate round by round (order flipped every round); reported: each round's grouped / plain
ratios and their medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the repository: tests.helpers

KEYS = ("rows", "rows_off_rank", "bytes_off_rank")


def job(rank: int, world: int, shape: str, grouped: bool, warmup: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from deepspeed.utils import logger
    from train_throughput import SHAPES, _batches, moetrain_trainer

    logger.setLevel("WARNING")
    groups = [f"moe.n_group={world}", "moe.topk_group=1"] if grouped else []
    trainer = moetrain_trainer(world, groups, SHAPES[shape])
    times, records = [], []
    for i, batch in enumerate(_batches(rank, world, warmup + steps, SHAPES[shape])):
        dist.barrier()
        t0 = time.perf_counter()
        rec = trainer.train_step([batch])
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            records.append([rec[f"comm/a2a_{k}"] for k in KEYS])
    per_step = [statistics.median(col) for col in zip(*records, strict=True)]
    return {"step_s": statistics.median(times), **dict(zip(KEYS, per_step, strict=True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="fine", help="a shape of train_throughput.py")
    ap.add_argument("--eps", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.helpers.distributed import run_distributed

    for ep in args.eps:
        ratios: dict[str, list[float]] = {"step_s": [], **{k: [] for k in KEYS}}
        for rnd in range(args.rounds):
            order = [False, True] if rnd % 2 == 0 else [True, False]
            res = {}
            for grouped in order:
                ranks = run_distributed(
                    job, ep, args.shape, grouped, args.warmup, args.steps, timeout=3600.0
                )
                r = dict(ranks[0], step_s=max(x["step_s"] for x in ranks))
                res[grouped] = r
                name = "grouped" if grouped else "plain"
                print(
                    f"ep {ep} round {rnd} {name}: step {r['step_s']:.3f} s, rows {r['rows']:.0f},"
                    f" off-rank rows {r['rows_off_rank']:.0f}, off-rank bytes "
                    f"{r['bytes_off_rank'] / 2**20:.2f} MiB",
                    flush=True,
                )
            for key in ratios:
                ratios[key].append(res[True][key] / res[False][key])
        summary = ", ".join(
            f"{k} {statistics.median(v):.3f}x ({'/'.join(f'{x:.3f}' for x in v)})"
            for k, v in ratios.items()
        )
        print(f"ep {ep} grouped / plain, median (per round): {summary}", flush=True)


if __name__ == "__main__":
    main()
