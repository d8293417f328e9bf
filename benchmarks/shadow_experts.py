"""Training steps over real text with and without shadow experts (``parallel.shadow_experts``),
paired step by step in the same two processes.

    .venv/bin/python benchmarks/shadow_experts.py
    .venv/bin/python benchmarks/shadow_experts.py --steps 40 --shadows 1

moetrain's Trainer at a ``train_throughput.py`` shape (default ``bench``), 2 gloo ranks, EP 2,
ZeRO-2, one thread per rank, over micro-batches of the token shards ``train_command.py``
prepares (the built-in corpus; real text routes unevenly, uniform random tokens do not). After
two warm-up steps shadows are on for two steps and off for the next two, and so on, on both
ranks at once. Printed per rank and case: the median step time, forward + backward, the
optimizer step, and the copies the busier EP rank computed per MoE layer and forward over the
mean of the two ranks (what the plan evens out; one more small all-gather per layer in both
cases).
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


def _text_batches(data: Path, rank: int, n: int, shape: dict, micro: int) -> list[dict]:
    """``n`` micro-batches of this rank: sequences at seeded random offsets of the shards."""
    import numpy as np
    import torch

    tokens = np.memmap(data / "train-00000.bin", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(1000 + rank)
    seq, out = shape["seq"], []
    for _ in range(n):
        starts = rng.integers(0, len(tokens) - seq - 1, micro)
        rows = torch.from_numpy(
            np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int64)
        )
        out.append({"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()})
    return out


def paired_job(rank: int, world: int, shape: str, steps: int, shadows: int, data: str) -> dict:
    import torch
    from train_throughput import MICRO, SHAPES, moetrain_trainer

    from moetrain.parallel.expert_parallel import moe_layers

    torch.set_num_threads(1)
    trainer = moetrain_trainer(2, [f"parallel.shadow_experts={shadows}"], SHAPES[shape])
    dispatchers = [layer.dispatcher for _, layer in moe_layers(trainer.model)]
    busiest: list[float] = []
    for d in dispatchers:  # the copies each rank computes, per layer and forward
        original = d.dispatch

        def dispatch(x, routes, overlap=None, _d=d, _orig=original):  # noqa: ANN001, ANN202
            out = _orig(x, routes, overlap)
            loads = [torch.zeros(1, dtype=torch.int64) for _ in range(_d.ep_size)]
            torch.distributed.all_gather(loads, out[2].sum().view(1), group=_d.group)
            loads_P = torch.cat(loads).double()
            busiest.append(float(loads_P.max() / loads_P.mean()))
            return out

        d.dispatch = dispatch
    batches = _text_batches(Path(data), rank, steps + 2, SHAPES[shape], MICRO)
    for batch in batches[:2]:
        trainer.train_step([batch])
    times: dict[str, list[tuple[float, ...]]] = {"shadows": [], "none": []}
    for i, batch in enumerate(batches[2:]):
        case = "shadows" if (i // 2) % 2 == 0 else "none"
        for d in dispatchers:
            d.max_shadows = shadows if case == "shadows" else 0
        busiest.clear()
        start = time.perf_counter()
        rec = trainer.train_step([batch])
        wall = time.perf_counter() - start
        times[case].append(
            (wall, rec["time/fwd_bwd_s"], rec["time/optimizer_s"], statistics.mean(busiest))
        )
    return {
        case: [statistics.median(t[j] for t in rows) for j in range(4)]
        for case, rows in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--shadows", type=int, default=2)
    ap.add_argument("--shape", default="bench", help="a shape of train_throughput.py")
    args = ap.parse_args()
    from train_command import prepare
    from train_throughput import SHAPES

    from tests.helpers.distributed import run_distributed

    data = prepare(SHAPES[args.shape], 4000)
    ranks = run_distributed(
        paired_job, 2, args.shape, args.steps, args.shadows, str(data), timeout=1800.0
    )
    print(
        f"\nshape {args.shape}, 2 ranks, EP 2, ZeRO-2, real text, up to {args.shadows} shadows "
        f"per layer, {args.steps} steps alternating in pairs"
    )
    print("| rank | case | step s | forward + backward s | optimizer step s | busier rank / mean |")
    print("|---|---|---:|---:|---:|---:|")
    for rank, res in enumerate(ranks):
        for case, (wall, fwd_bwd, optim, busy) in res.items():
            print(f"| {rank} | {case} | {wall:.3f} | {fwd_bwd:.3f} | {optim:.3f} | {busy:.2f} |")


if __name__ == "__main__":
    main()
