"""The optimizer step with and without the gradient partition taken in place
(``moetrain.parallel.grad_partitions``), paired step by step in the same two processes.

    .venv/bin/python benchmarks/grad_partitions.py
    .venv/bin/python benchmarks/grad_partitions.py --steps 40 --shape fine

moetrain's Trainer at a ``train_throughput.py`` shape (default ``bench``), 2 gloo ranks, EP 2,
ZeRO-2, one thread per rank. After two warm-up steps the hook is installed for two steps and
removed for the next two (DeepSpeed's own methods: the gradient copied into the next free place
of its buffer, the partition concatenated at the step), and so on for ``--steps`` steps, on both
ranks at once. Printed per rank: the median step time and its two phases as the trainer times
them (forward + backward with the gradient reduction, optimizer step) for each case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the repository: tests.helpers


def paired_job(rank: int, world: int, shape: str, steps: int) -> dict[str, list[float]]:
    import torch
    from train_throughput import SHAPES, _batches, moetrain_trainer

    from moetrain.parallel.grad_partitions import (
        HOOKED_METHODS,
        flatten_grad_partitions_in_place,
    )

    torch.set_num_threads(1)
    trainer = moetrain_trainer(2, [], SHAPES[shape])
    opt = trainer.engine.optimizer
    batches = _batches(rank, world, steps + 2, SHAPES[shape])
    for batch in batches[:2]:
        trainer.train_step([batch])
    times: dict[str, list[tuple[float, float, float]]] = {"in place": [], "concatenated": []}
    for i, batch in enumerate(batches[2:]):
        for name in HOOKED_METHODS:
            opt.__dict__.pop(name, None)  # DeepSpeed's methods again
        case = "in place" if (i // 2) % 2 == 0 else "concatenated"
        if case == "in place":
            flatten_grad_partitions_in_place(opt)
        start = time.perf_counter()
        rec = trainer.train_step([batch])
        wall = time.perf_counter() - start
        times[case].append((wall, rec["time/fwd_bwd_s"], rec["time/optimizer_s"]))
    return {
        case: [statistics.median(t[j] for t in rows) for j in range(3)]
        for case, rows in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--shape", default="bench", help="a shape of train_throughput.py")
    args = ap.parse_args()
    from tests.helpers.distributed import run_distributed

    ranks = run_distributed(paired_job, 2, args.shape, args.steps, timeout=1800.0)
    print(f"\nshape {args.shape}, 2 ranks, EP 2, ZeRO-2, {args.steps} steps alternating in pairs")
    print("| rank | case | step s | forward + backward s | optimizer step s |")
    print("|---|---|---:|---:|---:|")
    for rank, res in enumerate(ranks):
        for case, (wall, fwd_bwd, optim) in res.items():
            print(f"| {rank} | {case} | {wall:.3f} | {fwd_bwd:.3f} | {optim:.3f} |")


if __name__ == "__main__":
    main()
