"""AdamW step time on CPU: torch's per-op, foreach and fused implementations.

    .venv/bin/python benchmarks/optimizer_step.py
    .venv/bin/python benchmarks/optimizer_step.py --numel 50000000 --threads 2

One flat fp32 parameter of ``--numel`` elements (what a ZeRO-1/2 rank's optimizer sees: one
flat partition per parameter group; the default is a rank's partition in
``benchmarks/train_throughput.py``), AdamW with moetrain's defaults (betas 0.9/0.95, weight
decay 0.1). Median CPU time of ``--steps`` steps after one warm-up step, and the largest
difference of the weights from the per-op implementation after those steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VARIANTS = {"per-op (foreach=False)": {"foreach": False}, "foreach": {"foreach": True}}
VARIANTS["fused (moetrain's choice)"] = {"fused": True}


def run(numel: int, steps: int, options: dict) -> tuple[float, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=g))
    grad = torch.randn(numel, generator=g)
    opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **options)
    times = []
    for i in range(steps + 1):
        param.grad = grad
        t = time.process_time()
        opt.step()
        if i:
            times.append(time.process_time() - t)
    return statistics.median(times), param.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=8_700_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {name: run(args.numel, args.steps, opts) for name, opts in VARIANTS.items()}
    base_s, base_w = results["per-op (foreach=False)"]
    print(f"AdamW on {args.numel:,} fp32 elements, {args.threads} thread(s)\n")
    print("| implementation | ms / step | speed-up | max weight diff vs per-op |")
    print("|---|---:|---:|---:|")
    for name, (sec, w) in results.items():
        diff = float((w - base_w).abs().max())
        print(f"| {name} | {1e3 * sec:.1f} | {base_s / sec:.1f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
