"""The matrix-multiply floor of one rank's training step: every GEMM (and the attention kernel)
of the step at a ``train_throughput.py`` shape, timed alone on one thread with nothing else.

    .venv/bin/python benchmarks/step_floor.py                 # bench shape
    .venv/bin/python benchmarks/step_floor.py --shape fine --rounds 5

One rank's share of a data-parallel step at micro-batch ``MICRO``: per layer the q/k/v/o
projections, causal SDPA, the router and the expert GEMMs (forward, input gradient, weight
gradient; the experts get an even split of the copies, as balanced expert parallelism would give
each rank: T x top_k copies over its experts), then the LM head's three GEMMs. Each block is
the best of ``--rounds`` timings of the block run whole. The sum is what the step cannot go
below at this machine's GEMM speed, whichever trainer runs it: the gap between it and a measured
step is everything else (optimizer, communication and waiting, elementwise work, Python).

The GEMMs run through :mod:`moetrain.model.cpu_matmul`, once with each of its kernels
(``--cpu-matmul``): ``torch`` (torch's own, MKL's sgemm; what a trainer built on ``nn.Linear``
gets) and ``onednn`` (moetrain's default). Attention is torch's SDPA kernel in both.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import MICRO, SHAPES  # noqa: E402

from moetrain.model import cpu_matmul  # noqa: E402
from moetrain.model.cpu_matmul import add_product_, grouped_mm, mm  # noqa: E402

Block = tuple[Callable[[], None], float]  # a block's GEMMs to run, and their FLOPs


def best_ms(fn: Callable[[], None], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def linear_fwd_bwd(n: int, d_in: int, d_out: int) -> Block:
    """Forward, input gradient and weight gradient of ``x @ w.T`` for ``n`` rows."""
    x, w, g = torch.randn(n, d_in), torch.randn(d_out, d_in), torch.randn(n, d_out)

    def run() -> None:
        mm(x, w.t())
        mm(g, w)
        mm(g.t(), x)

    return run, 3 * 2.0 * n * d_in * d_out


def lm_head_fwd_bwd(n: int, d: int, vocab: int) -> Block:
    """The LM head's forward, input gradient and weight gradient, as the chunked loss runs
    them (its weight gradient accumulates through ``add_product_``)."""
    h, w, g = torch.randn(n, d), torch.randn(vocab, d), torch.randn(n, vocab)
    grad_w = torch.zeros(vocab, d)

    def run() -> None:
        mm(h, w.t())
        mm(g, w)
        add_product_(grad_w, g.t(), h)

    return run, 3 * 2.0 * n * d * vocab


def experts_fwd_bwd(copies: int, local: int, d: int, hidden: int) -> Block:
    """The grouped SwiGLU experts' GEMMs (w13 and w2: forward, input and weight gradients)."""
    per = [copies // local + (i < copies % local) for i in range(local)]
    offs = torch.tensor(per).cumsum(0).to(torch.int32)
    x, h = torch.randn(copies, d), torch.randn(copies, hidden)
    g13, g2 = torch.randn(copies, 2 * hidden), torch.randn(copies, d)
    w13, w2 = torch.randn(local, d, 2 * hidden), torch.randn(local, hidden, d)

    def run() -> None:
        grouped_mm(x, w13, offs)
        grouped_mm(h, w2, offs)
        grouped_mm(g2, w2.transpose(1, 2), offs)
        grouped_mm(h.t(), g2, offs)
        grouped_mm(g13, w13.transpose(1, 2), offs)
        grouped_mm(x.t(), g13, offs)

    return run, 3 * 2.0 * copies * (d * 2 * hidden + hidden * d)


def attention_fwd_bwd(b: int, heads: int, kv_heads: int, s: int, hd: int) -> Block:
    q = torch.randn(b, heads, s, hd, requires_grad=True)
    k = torch.randn(b, kv_heads, s, hd, requires_grad=True)
    v = torch.randn(b, kv_heads, s, hd, requires_grad=True)
    grad = torch.randn(b, heads, s, hd)

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)

    # forward: two GEMMs over half the score matrix (causal); backward counted as twice forward
    return run, 3 * 2 * 2.0 * b * heads * s * s * hd / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel size (experts per rank)")
    ap.add_argument(
        "--cpu-matmul", nargs="+", choices=cpu_matmul.CHOICES, default=list(cpu_matmul.CHOICES)
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    s = SHAPES[args.shape]
    n, d, hd = MICRO * s["seq"], s["d"], s["d"] // s["heads"]
    layers = s["layers"]
    blocks = {
        "attention projections (q, k, v, o)": [
            linear_fwd_bwd(n, d, d),
            linear_fwd_bwd(n, d, s["kv_heads"] * hd),
            linear_fwd_bwd(n, d, s["kv_heads"] * hd),
            linear_fwd_bwd(n, d, d),
        ],
        "attention (SDPA, causal)": [
            attention_fwd_bwd(MICRO, s["heads"], s["kv_heads"], s["seq"], hd)
        ],
        "router": [linear_fwd_bwd(n, d, s["experts"])],
        "experts": [experts_fwd_bwd(n * s["top_k"], s["experts"] // args.ep, d, s["hidden"])],
    }
    if "shared_hidden" in s:
        blocks["shared expert"] = [
            linear_fwd_bwd(n, d, 2 * s["shared_hidden"]),
            linear_fwd_bwd(n, s["shared_hidden"], d),
        ]
    blocks["LM head"] = [lm_head_fwd_bwd(n, d, s["vocab"])]
    ms: dict[str, list[float]] = {}
    for kernel in args.cpu_matmul:
        cpu_matmul.use_cpu_matmul(kernel)
        ms[kernel] = [
            sum(best_ms(run, args.rounds) for run, _ in parts) for parts in blocks.values()
        ]
    scale = [1 if name.startswith("LM head") else layers for name in blocks]
    flops = [sum(f for _, f in parts) * k for parts, k in zip(blocks.values(), scale, strict=True)]
    print(f"shape {args.shape}, EP {args.ep}, {n} tokens per rank, one thread")
    head = " | ".join(f"{k} ms | {k} GFLOP/s" for k in args.cpu_matmul)
    print(f"| GEMMs of one rank's step | GFLOP | {head} |")
    print("|---|---:|" + "---:|---:|" * len(args.cpu_matmul))
    totals = {k: sum(t * c for t, c in zip(ms[k], scale, strict=True)) for k in args.cpu_matmul}
    for i, name in enumerate(blocks):
        label = name if scale[i] == 1 else f"{name}, {layers} layers"
        cells = " | ".join(
            f"{ms[k][i] * scale[i]:.1f} | {flops[i] / (ms[k][i] * scale[i]) / 1e6:.0f}"
            for k in args.cpu_matmul
        )
        print(f"| {label} | {flops[i] / 1e9:.2f} | {cells} |")
    cells = " | ".join(f"**{totals[k]:.0f}** | {sum(flops) / totals[k] / 1e6:.0f}" for k in totals)
    print(f"| **floor** | {sum(flops) / 1e9:.1f} | {cells} |")
    tokens = 2 * n  # both ranks' tokens per optimizer step
    for k, total in totals.items():
        print(
            f"at the floor with {k} the 2-rank step would run {tokens / total * 1e3:.0f} tokens/s"
        )


if __name__ == "__main__":
    main()
