"""CPU efficiency: achieved model FLOP/s of moetrain training vs this machine's fp32 matmul rate.

    .venv/bin/python benchmarks/cpu_efficiency.py                  # 1 and 2 threads
    .venv/bin/python benchmarks/cpu_efficiency.py --threads 1 --steps 3

One process, fp32, CPU. A small MoE Transformer (moetrain's model, grouped experts) trains with
torch.optim.AdamW: forward + backward + optimizer step + zero_grad. Model FLOPs per token come
from ``moetrain.numbers.model_numbers`` (6 x active matmul params + attention; the optimizer's
element-wise work is not counted). The denominator is the fp32 ``torch.matmul`` rate measured in
the same run at the GEMM sizes training uses (projections, experts, LM head) and one square
2048^3; the best of them is taken, so the fraction is conservative. Matmul and training rounds
alternate, so load from other processes hits both alike; the best round of each is reported
(the least-disturbed one).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moetrain.config import Config, apply_overrides, config_from_dict
from moetrain.model import Transformer
from moetrain.numbers import model_numbers

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
    torch.matmul(a, b)
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or reps < 3:
        torch.matmul(a, b)
        reps += 1
    return 2.0 * m * k * n * reps / elapsed / 1e12


def train_rate(model: Transformer, opt: torch.optim.Optimizer, cfg: Config, steps: int) -> float:
    """Tokens per second over ``steps`` training steps."""
    b, s, v = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    batches = [(torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))) for _ in range(steps)]
    start = time.perf_counter()
    for ids, labels in batches:
        out = model(ids, labels_BS=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return b * s * steps / (time.perf_counter() - start)


def run(threads: int, steps: int, rounds: int, grouped_mm: bool = True) -> dict[str, object]:
    torch.set_num_threads(threads)
    cfg = bench_config({"moe.grouped_mm": grouped_mm})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_rate(model, opt, cfg, 1)  # warm-up: optimizer states, kernels, allocator
    flops = model_numbers(cfg).flops_per_token
    shapes = gemm_shapes(cfg)
    best_mm = dict.fromkeys(shapes, 0.0)
    best_train = 0.0
    for _ in range(rounds):
        for shape in shapes:
            best_mm[shape] = max(best_mm[shape], matmul_tflops(*shape))
        best_train = max(best_train, train_rate(model, opt, cfg, steps))
    achieved = best_train * flops / 1e12
    reference = max(best_mm.values())
    return {
        "threads": threads,
        "grouped_mm": grouped_mm,
        "tokens_per_s": best_train,
        "flops_per_token": flops,
        "model_tflops": achieved,
        "matmul_tflops": {f"{m}x{k}x{n}": v for (m, k, n), v in best_mm.items()},
        "matmul_reference_tflops": reference,
        "efficiency": achieved / reference,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=3, help="training steps per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop", action="store_true", help="per-expert loop instead of grouped_mm")
    ap.add_argument("--json", action="store_true", help="print JSON lines only")
    args = ap.parse_args()
    if not args.json:
        print(f"shape: {json.dumps(SHAPE)}  (torch {torch.__version__})")
        print("threads | tokens/s | model GFLOP/s | best matmul GFLOP/s | efficiency")
    for threads in args.threads:
        res = run(threads, args.steps, args.rounds, grouped_mm=not args.loop)
        if args.json:
            print(json.dumps(res))
            continue
        print(
            f"{threads:7d} | {res['tokens_per_s']:8.0f} | {res['model_tflops'] * 1e3:13.1f} | "
            f"{res['matmul_reference_tflops'] * 1e3:19.1f} | {res['efficiency']:.1%}"
        )
        print(
            "        matmul GFLOP/s by (m x k x n): "
            + ", ".join(
                f"{k} {v * 1e3:.1f}"
                for k, v in res["matmul_tflops"].items()  # type: ignore[union-attr]
            )
        )


if __name__ == "__main__":
    main()
