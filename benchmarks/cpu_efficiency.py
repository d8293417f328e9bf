"""CPU efficiency: achieved model FLOP/s of moetrain training vs this machine's fp32 matmul rate.

    .venv/bin/python benchmarks/cpu_efficiency.py                  # 1 and 2 threads
    .venv/bin/python benchmarks/cpu_efficiency.py --threads 1 --steps 3

One process, fp32, CPU. A small MoE Transformer (moetrain's model, grouped experts) trains with
torch.optim.AdamW: forward + backward + optimizer step + zero_grad. Model FLOPs per token come
from ``moetrain.model_numbers.model_numbers`` (6 x active matmul params + attention; the optimizer's
element-wise work is not counted). The denominator is the fp32 matmul rate, through the kernel
the model uses (``moetrain.model.cpu_matmul``, ``--cpu-matmul``: oneDNN by default), measured in
the same run: first at the GEMM sizes training uses (projections, experts, LM head) and one
square 2048^3, then, after every training step, again at the fastest of those sizes. Each
(step, matmul) pair sees the same load from other processes; the efficiency is the median over
pairs of model FLOP/s / matmul FLOP/s (min and max shown too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moetrain.config import Config, apply_overrides, config_from_dict
from moetrain.model import Transformer, cpu_matmul
from moetrain.model_numbers import model_numbers

SHAPE = {
    "model.vocab_size": 8192,
    "model.d_model": 512,
    "model.n_layers": 4,
    "model.n_heads": 8,
    "model.n_kv_heads": 4,
    "moe.num_experts": 8,
    "moe.top_k": 2,
    "moe.expert_hidden": 1024,
    "data.seq_len": 256,
    "train.micro_batch_size": 4,
}


def bench_config(overrides: dict[str, object] | None = None) -> Config:
    merged = {**SHAPE, **(overrides or {})}
    return config_from_dict(apply_overrides({}, [f"{k}={v}" for k, v in merged.items()]))


def gemm_shapes(cfg: Config) -> list[tuple[int, int, int]]:
    """(m, k, n) of the main training matmuls: attention projection, one expert's share of the
    routed copies, the LM head; plus a square 2048^3 reference."""
    m, e = cfg.model, cfg.moe
    t = cfg.train.micro_batch_size * cfg.data.seq_len
    per_expert = t * e.top_k // e.num_experts
    return [
        (t, m.d_model, m.d_model),
        (per_expert, m.d_model, e.expert_hidden),
        (t, m.d_model, m.vocab_size),
        (2048, 2048, 2048),
    ]


def matmul_tflops(m: int, k: int, n: int, min_seconds: float = 0.5) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    cpu_matmul.mm(a, b)
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or reps < 3:
        cpu_matmul.mm(a, b)
        reps += 1
    return 2.0 * m * k * n * reps / elapsed / 1e12


def train_step_seconds(model: Transformer, opt: torch.optim.Optimizer, cfg: Config) -> float:
    """Wall time of one whole training step (forward, backward, AdamW step, zero_grad)."""
    b, s, v = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    ids, labels = torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))
    start = time.perf_counter()
    out = model(ids, labels_BS=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run(threads: int, steps: int, grouped_mm: bool = True) -> dict[str, object]:
    """Pairs (training step, matmul timing right after it); the median of the per-pair ratios
    is the efficiency, so both sides of each ratio see the same load from other processes."""
    torch.set_num_threads(threads)
    cfg = bench_config({"moe.grouped_mm": grouped_mm})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step_seconds(model, opt, cfg)  # warm-up: optimizer states, kernels, allocator
    flops = model_numbers(cfg).flops_per_token
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    by_shape = {shape: matmul_tflops(*shape) for shape in gemm_shapes(cfg)}
    ref_shape = max(by_shape, key=by_shape.__getitem__)  # the fastest GEMM size here
    pairs = []
    for _ in range(steps):
        model_tflops = tokens * flops / train_step_seconds(model, opt, cfg) / 1e12
        pairs.append((model_tflops, matmul_tflops(*ref_shape)))
    ratios = sorted(m / r for m, r in pairs)
    return {
        "threads": threads,
        "grouped_mm": grouped_mm,
        "flops_per_token": flops,
        "tokens_per_step": tokens,
        "matmul_tflops_by_shape": {f"{m}x{k}x{n}": v for (m, k, n), v in by_shape.items()},
        "reference_shape": "x".join(map(str, ref_shape)),
        "pairs_model_vs_matmul_tflops": pairs,
        "model_tflops_median": statistics.median(m for m, _ in pairs),
        "matmul_tflops_median": statistics.median(r for _, r in pairs),
        "efficiency": statistics.median(ratios),
        "efficiency_min_max": (ratios[0], ratios[-1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=5, help="(training step, matmul) pairs")
    ap.add_argument("--loop", action="store_true", help="per-expert loop instead of grouped_mm")
    ap.add_argument("--json", action="store_true", help="print JSON lines only")
    ap.add_argument("--cpu-matmul", choices=cpu_matmul.CHOICES, default="onednn")
    args = ap.parse_args()
    cpu_matmul.use_cpu_matmul(args.cpu_matmul)
    if not args.json:
        print(f"shape: {json.dumps(SHAPE)}  (torch {torch.__version__}, {args.cpu_matmul})")
        print("threads | model GFLOP/s | matmul GFLOP/s (m x k x n) | efficiency (median of pairs)")
    for threads in args.threads:
        res = run(threads, args.steps, grouped_mm=not args.loop)
        if args.json:
            print(json.dumps(res))
            continue
        lo, hi = res["efficiency_min_max"]  # type: ignore[misc]
        print(
            f"{threads:7d} | {res['model_tflops_median'] * 1e3:13.1f} | "
            f"{res['matmul_tflops_median'] * 1e3:14.1f} ({res['reference_shape']}) | "
            f"{res['efficiency']:.1%} (range {lo:.1%}-{hi:.1%})"
        )


if __name__ == "__main__":
    main()
