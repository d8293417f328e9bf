"""DeepSeek-V4's training step (forward and backward, no optimizer) in one process: moetrain's
model against transformers' ``DeepseekV4ForCausalLM`` (eager attention), both from the source
model of ``train_command.py --family deepseek_v4`` (``family_source.py``: the bench size), on
one batch of ``train_command.py``'s micro-batch (4 x 256 tokens), one thread.

    .venv/bin/python benchmarks/v4_step.py --rounds 6
    .venv/bin/python benchmarks/v4_step.py --blocks --rounds 6      # block by block
    .venv/bin/python benchmarks/v4_step.py --rounds 0 --profile hc  # an op table

Sides, alternating round by round: moetrain with each fp32 CPU matmul kernel
(``train.cpu_matmul``: ``onednn``, ``torch``; ``auto`` picks one of them by the CPU) and the
peer. Each step is timed in the process's CPU time (less moved by other jobs on a shared
machine than wall time) and in wall time; printed: the medians and each moetrain side's ratio
to the peer per round (peer time / moetrain time: above 1 is moetrain faster). The two models'
first cross-entropies are printed too (the same function on the same weights and batch).

``--blocks``: moetrain with the kernel ``auto`` picks against the peer, the whole step and each
block alone (forward and backward of the modules on the inputs the step gave them, against a
fixed output gradient, summed over the layers), CPU time: ``hc`` (both hyper-connections of
each layer: coefficients, Sinkhorn, collapse; the streams' mix runs in the layer itself on
both sides), ``attention`` (the token mixer), ``moe`` (router, experts, shared expert).
``--profile BLOCK`` (or ``step``) prints ``torch.profiler``'s op table of that block per side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step_sides import (  # noqa: E402
    compare_blocks,
    load_sides,
    moetrain_step,
    peer_step,
)

BLOCKS = ("hc", "attention", "moe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--blocks", action="store_true", help="time each block alone too")
    ap.add_argument(
        "--profile", choices=("step", *BLOCKS), help="print this block's op table per side"
    )
    args = ap.parse_args()
    import torch

    from moetrain.model import cpu_matmul

    torch.set_num_threads(1)
    ours, peer, ids = load_sides("deepseek_v4", attn_implementation="eager")
    if args.blocks or args.profile:
        cpu_matmul.use_cpu_matmul(cpu_matmul.preferred_kernel())  # train.cpu_matmul: auto
        by_blocks(ours, peer, ids, args)
        return

    def moetrain_with(kernel: str) -> float:
        cpu_matmul.use_cpu_matmul(kernel)
        return moetrain_step(ours, ids)

    sides = {"moetrain onednn": lambda: moetrain_with("onednn")}
    sides |= {
        "moetrain torch": lambda: moetrain_with("torch"),
        "peer": lambda: peer_step(peer, ids),
    }
    ce = {name: step() for name, step in sides.items()}  # (warm-up)
    print("first cross-entropy:", {k: round(v, 7) for k, v in ce.items()})
    print(f"auto picks {cpu_matmul.preferred_kernel()} here")
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    wall: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, step in sides.items():
            c, w = time.process_time(), time.perf_counter()
            step()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    for name in sides:
        print(
            f"{name:16s} CPU {statistics.median(cpu[name]) * 1e3:6.0f} ms, "
            f"wall {statistics.median(wall[name]) * 1e3:6.0f} ms per step"
        )
    for name in sides:
        if name == "peer":
            continue
        for label, times in (("CPU", cpu), ("wall", wall)):
            ratios = [p / m for p, m in zip(times["peer"], times[name], strict=True)]
            print(
                f"peer / {name}, {label}: {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}x)"
            )


def by_blocks(ours, peer, ids, args: argparse.Namespace) -> None:  # noqa: ANN001
    """The whole step and each block alone per side (module docstring), or a block's op table."""
    ours_mods = {
        "hc": [hc for b in ours.layers for hc in (b.attn_hc, b.ffn_hc)],
        "attention": [b.attn for b in ours.layers],
        "moe": [b.ffn for b in ours.layers],
    }
    layers = peer.model.layers
    peer_mods = {
        "hc": [hc for lay in layers for hc in (lay.attn_hc, lay.ffn_hc)],
        "attention": [lay.self_attn for lay in layers],
        "moe": [lay.mlp for lay in layers],
    }
    sides = {
        "moetrain": (ours, ours_mods, lambda: moetrain_step(ours, ids)),
        "peer": (peer, peer_mods, lambda: peer_step(peer, ids)),
    }
    compare_blocks(sides, BLOCKS, args.rounds, args.profile)


if __name__ == "__main__":
    main()
