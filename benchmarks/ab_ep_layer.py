"""A/B of one expert-parallel MoE layer (forward + backward) between two checkouts.

    .venv/bin/python benchmarks/ab_ep_layer.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 10]

Each round starts, in each checkout (its own ``moetrain`` first on ``PYTHONPATH``, alternating
which goes first), 2 gloo ranks that build the same ``MoELayer`` (d 256, 8 experts, top-2,
expert hidden 512: train_throughput.py's ``bench`` shape; ``--experts``, ``--top-k``,
``--hidden`` change it, e.g. 64 / 8 / 128 for its ``fine`` shape),
make it expert-parallel (4 experts per rank) and time ``--iters`` forward + backward passes of
``--tokens`` tokens per rank after ``--warmup``. Reported per round and checkout: the median
wall time and the median CPU time (this process's user + system time, less sensitive to other
processes' load than wall time) of one pass, the slower rank's; then the paired new / old
ratios with their medians and ranges. Uses only what both checkouts share
(``MoELayer``, ``AllToAllDispatcher(E, ep, rank, group)``, ``slice_experts``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def job(rank: int, world: int, args: dict) -> dict:
    import time

    import torch

    from moetrain.config import MoEConfig
    from moetrain.model.moe.layer import MoELayer
    from moetrain.parallel.expert_parallel import AllToAllDispatcher, slice_experts

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=args["experts"], top_k=args["top_k"], expert_hidden=args["hidden"])
    layer = MoELayer(cfg, 256)
    per_rank = args["experts"] // world
    slice_experts(layer.experts, rank * per_rank, (rank + 1) * per_rank)
    layer.dispatcher = AllToAllDispatcher(args["experts"], world, rank, None)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, args["tokens"], 256, generator=g).requires_grad_(True)
    wall, cpu = [], []
    for i in range(args["warmup"] + args["iters"]):
        w0, c0 = time.perf_counter(), time.process_time()
        y, stats = layer(x)
        (y.square().mean() + 0.01 * stats.aux_loss).backward()
        if i >= args["warmup"]:
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}


def run_once(checkout: Path, args: dict) -> dict:
    """Both ranks' medians in ``checkout`` -> the slower rank's."""
    env = dict(os.environ, PYTHONPATH=f"{checkout}:{HERE.parents[1]}", OMP_NUM_THREADS="1")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "from ab_ep_layer import job; from tests.helpers.distributed import run_distributed;"
        "print(json.dumps(run_distributed(job, 2, json.loads(sys.argv[2]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(HERE.parent), json.dumps(args)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}: {out.stdout[-2000:]}{out.stderr[-3000:]}")
    ranks = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: max(r[k] for r in ranks) for k in ("wall_s", "cpu_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    keys = ("tokens", "experts", "top_k", "hidden", "iters", "warmup")
    args = {k: getattr(a, k) for k in keys}
    ratios: dict[str, list[float]] = {"wall_s": [], "cpu_s": []}
    for rnd in range(a.rounds):
        order = [("old", a.old), ("new", a.new)]
        if rnd % 2:
            order.reverse()
        res = {name: run_once(path.resolve(), args) for name, path in order}
        for key in ratios:
            ratios[key].append(res["new"][key] / res["old"][key])
        print(
            f"round {rnd}: old wall {res['old']['wall_s'] * 1e3:.1f} ms cpu "
            f"{res['old']['cpu_s'] * 1e3:.1f} ms, new wall {res['new']['wall_s'] * 1e3:.1f} ms "
            f"cpu {res['new']['cpu_s'] * 1e3:.1f} ms",
            flush=True,
        )
    for key, vals in ratios.items():
        print(
            f"{key} new/old: median {statistics.median(vals):.3f} "
            f"(range {min(vals):.3f}-{max(vals):.3f}, {len(vals)} paired rounds)"
        )


if __name__ == "__main__":
    main()
