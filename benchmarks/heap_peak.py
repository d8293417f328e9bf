"""How much of a rank's peak memory is live data, and how much is the heap's layout.

    .venv/bin/python benchmarks/heap_peak.py --shape shared            # oneDNN vs torch kernels
    .venv/bin/python benchmarks/heap_peak.py --steps 30 --variants ""  # the default config only

moetrain's Trainer as ``benchmarks/train_throughput.py`` builds it (2 ranks, EP 2, ZeRO-2, one
thread each, its process set up as ``moetrain train``'s: one glibc arena that never shrinks), for
``--steps`` steps over random tokens. A thread of each rank reads glibc's ``mallinfo2`` every
half millisecond and keeps the highest count of bytes handed out and not yet freed (the live
heap: every CPU tensor and buffer torch, oneDNN and DeepSpeed allocate with malloc). At the end:

- peak RSS (``ru_maxrss``, as ``train_throughput.py`` reports it);
- peak live heap, the most the step had in use at once;
- heap size (``mallinfo2.arena``): with the heap never trimmed (``train.host_allocator=keep``,
  the default), its high-water mark; minus the peak live heap it is what the allocator's
  placement (holes between blocks in use) costs.

The variants (``--variants``, config overrides, ``""`` for none) alternate for ``--rounds``
rounds; per variant and figure the median over rounds of the maximum over ranks (the holes:
each rank's heap size minus its own live peak). The sampling thread takes some CPU from the
step, so this reports memory only.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the repository: tests.helpers

FIELDS = [
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


def _mallinfo2() -> _MallInfo2:
    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = _MallInfo2
    return fn()


def heap_job(rank: int, world: int, shape: str, steps: int, overrides: list[str]) -> dict:
    import torch
    from train_throughput import SHAPES, _batches, _peak_rss_mib, moetrain_trainer

    torch.set_num_threads(1)
    trainer = moetrain_trainer(2, overrides, SHAPES[shape])
    live_peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            live_peak[0] = max(live_peak[0], _mallinfo2().uordblks)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for batch in _batches(rank, world, steps, SHAPES[shape]):
        trainer.train_step([batch])
    stop.set()
    sampler.join()
    heap = _mallinfo2().arena
    return {
        "peak_rss_mib": _peak_rss_mib(),
        "live_heap_mib": live_peak[0] / 2**20,
        "heap_mib": heap / 2**20,
        "holes_mib": (heap - live_peak[0]) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="bench", help="a shape of train_throughput.py")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["train.cpu_matmul=onednn", "train.cpu_matmul=torch"],
        help="config overrides to compare, each 'KEY=VALUE[,KEY=VALUE]' ('' for none)",
    )
    args = ap.parse_args()
    if not sys.platform.startswith("linux"):
        ap.error("glibc's mallinfo2 is read: Linux only")
    from tests.helpers.distributed import run_distributed

    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for rnd in range(args.rounds):
        for variant in args.variants:
            overrides = [o for o in variant.split(",") if o]
            ranks = run_distributed(heap_job, 2, args.shape, args.steps, overrides, timeout=1800.0)
            row = {key: max(r[key] for r in ranks) for key in ranks[0]}
            results[variant].append(row)
            print(
                f"round {rnd} {variant or '(defaults)'}: "
                + ", ".join(f"{k} {v:.0f}" for k, v in row.items()),
                flush=True,
            )
    print(
        f"\nshape {args.shape}, {args.steps} steps, median of {args.rounds} rounds (max over ranks)"
    )
    print("| variant | peak RSS (MiB) | peak live heap | heap size | heap size - live peak |")
    print("|---|---:|---:|---:|---:|")
    for variant, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"| {variant or '(defaults)'} | {med['peak_rss_mib']:.0f} | {med['live_heap_mib']:.0f}"
            f" | {med['heap_mib']:.0f} | {med['holes_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
