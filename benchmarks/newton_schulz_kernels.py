"""Newton-Schulz of every Muon matrix of a benchmark shape's model, four ways, by CPU time in
one process (one thread): the shipped :func:`moetrain.optim.newton_schulz.orthogonalize`, two
earlier codes' and batched products into buffers over a whole batch; and the rate of one fp32
and one bf16 product. The products run on the kernel ``train.cpu_matmul`` picks
(``--cpu-matmul``, as ``moetrain train``: ``auto``, torch's own on an AVX2-only CPU), except the
whole-batch variant's, always torch's.

    .venv/bin/python benchmarks/newton_schulz_kernels.py --rounds 2 [--shape bench]
    .venv/bin/python benchmarks/newton_schulz_kernels.py --rounds 2 --cpu-matmul onednn
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from train_command import shape_overrides  # noqa: E402
from train_throughput import SHAPES  # noqa: E402

BATCH_ELEMENTS = 1 << 20  # the earlier code's batches (fp32 elements orthogonalised at once)


def _newton_schulz_variants() -> dict:
    """Newton-Schulz of a batch (N, rows, cols), four ways: the shipped one (stacks of
    ``STACK_ELEMENTS`` values, batched products into buffers), two earlier codes' (each product
    one call of the model's kernel per matrix, a new tensor for every intermediate: stacked
    over the batch; one matrix at a time), and batched products into buffers over the whole
    batch (``torch.bmm`` / ``baddbmm``, the scalings folded in)."""
    import torch

    from moetrain.model.cpu_matmul import mm
    from moetrain.optim.newton_schulz import DEFAULT_COEFFICIENTS, NORM_EPS, orthogonalize

    a, b, c = DEFAULT_COEFFICIENTS

    def normalised(g):  # noqa: ANN001, ANN202
        x = g.mT if g.shape[-2] > g.shape[-1] else g
        return (x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)).contiguous()

    def products(x, y):  # noqa: ANN001, ANN202
        return torch.stack([mm(p, q) for p, q in zip(x, y, strict=True)])

    def stacked(g, steps):  # noqa: ANN001, ANN202
        x = normalised(g)
        for _ in range(steps):
            gram = products(x, x.mT)
            x = a * x + products(b * gram + c * products(gram, gram), x)
        return x

    def batched(g, steps):  # noqa: ANN001, ANN202
        x = normalised(g)
        nxt, gram = torch.empty_like(x), x.new_empty(x.shape[0], x.shape[1], x.shape[1])
        poly = torch.empty_like(gram)
        for _ in range(steps):
            torch.bmm(x, x.mT, out=gram)
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
            torch.baddbmm(x, poly, x, beta=a, out=nxt)
            x, nxt = nxt, x
        return x

    def one_at_a_time(g, steps):  # noqa: ANN001, ANN202
        x = normalised(g)
        for i in range(len(x)):
            y = x[i]
            for _ in range(steps):
                gram = mm(y, y.mT)
                y = mm(mm(gram, gram.mT).mul_(c).add_(gram, alpha=b), y).add_(y, alpha=a)
            x[i] = y
        return x

    def shipped(g, steps):  # noqa: ANN001, ANN202
        return orthogonalize(g.mT if g.shape[-2] > g.shape[-1] else g, DEFAULT_COEFFICIENTS, steps)

    return {
        "shipped": shipped,
        "earlier: stacked per batch": stacked,
        "earlier: one matrix at a time": one_at_a_time,
        "batched bmm, whole batch": batched,
    }


def _product_rates(rows: int, cols: int) -> str:
    """GFLOP/s of one (rows x cols) @ (cols x rows) product in fp32 and in bf16 (torch's)."""
    import torch

    x = torch.randn(rows, cols)
    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        y @ y.T
        best = min(_seconds(lambda y=y: y @ y.T) for _ in range(5))
        rates.append(2 * rows * rows * cols / best / 1e9)
    return f"    one {rows}x{cols} Gram product: fp32 {rates[0]:.1f}, bf16 {rates[1]:.1f} GFLOP/s"


def _seconds(fn) -> float:  # noqa: ANN001
    """CPU seconds of ``fn()`` (this thread's: what other processes' load changes least)."""
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def kernels(args: argparse.Namespace) -> list[str]:
    """The Newton-Schulz variants on every Muon matrix of the shape's model (one process, the
    optimizer's batches, one thread, ``moetrain train``'s allocator setting), each batch by
    every variant in turn (the order alternating), over ``--rounds``: CPU time and deviation
    from the shipped fp32 result."""
    import torch

    from moetrain.config import load_config
    from moetrain.model.cpu_matmul import cpu_matmul_choice, use_cpu_matmul
    from moetrain.optim.kinds import matrix_blocks, meta_model
    from moetrain.optim.muon import update_of
    from moetrain.train.host_allocator import settle_host_allocator, tune_host_allocator

    torch.set_num_threads(1)
    use_cpu_matmul(args.cpu_matmul)
    tune_host_allocator("keep")  # (as moetrain train: freed blocks reused, not faulted in anew)
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", shape_overrides(SHAPES[args.shape]))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for name, p in meta_model(cfg).named_parameters():
        if update_of(name, p.ndim, cfg.optim) != "muon":
            continue
        blocks = matrix_blocks(name, tuple(p.shape))
        rows, width = blocks[0].rows, blocks[0].cols // blocks[0].splits
        matrices = len(blocks) * blocks[0].splits
        per_batch = max(1, BATCH_ELEMENTS // (rows * width))  # (as the earlier code)
        for at in range(0, matrices, per_batch):
            n = min(per_batch, matrices - at)
            batches.append(torch.randn(n, rows, width, generator=gen))
    variants, steps = _newton_schulz_variants(), cfg.optim.muon.ns_steps
    want = [variants["shipped"](g, steps) for g in batches]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rnd in range(args.rounds + 1):  # (the first round warms up; each batch in turn)
        took = dict.fromkeys(variants, 0.0)
        for i, g in enumerate(batches):
            for v in list(variants) if (rnd + i) % 2 == 0 else list(reversed(variants)):
                took[v] += _seconds(lambda v=v, g=g: variants[v](g, steps))
        if rnd > 0:
            for v in variants:
                times[v].append(took[v])
        settle_host_allocator()
    lines = [
        f"  Newton-Schulz of the {args.shape} model's Muon matrices, one thread, "
        f"cpu_matmul {args.cpu_matmul} ({cpu_matmul_choice()}):"
    ]
    largest = max(batches, key=lambda g: g[0].numel())
    lines.append(_product_rates(min(largest.shape[-2:]), max(largest.shape[-2:])))
    for v, fn in variants.items():
        dev = max(
            float((fn(g, steps) - w).abs().max() / w.abs().max())
            for g, w in zip(batches, want, strict=True)
        )
        ratios = [t / s for t, s in zip(times[v], times["shipped"], strict=True)]
        lines.append(
            f"    {v + ':':32s} {statistics.median(times[v]):.3f} CPU s, "
            f"{statistics.median(ratios):.2f}x the shipped (range {min(ratios):.2f}-"
            f"{max(ratios):.2f}x), largest deviation from it {dev:.1e} (of its largest value)"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--cpu-matmul", choices=("auto", "onednn", "torch"), default="auto")
    print("\n".join(kernels(ap.parse_args())))


if __name__ == "__main__":
    main()
