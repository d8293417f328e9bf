"""Qwen3-Next's training step (forward and backward, no optimizer) in one process, whole and block
by block: moetrain's model against transformers' ``Qwen3NextForCausalLM`` (its torch path: no fla
kernels on a CPU), both from the source model of ``train_command.py --family qwen3_next``
(``family_source.py``: vocab 8192, d 256, 3 Gated DeltaNet layers and 1 gated attention layer,
8 experts top-2 and a shared expert per layer), on one batch of ``train_command.py``'s
micro-batch (4 x 256 tokens), one thread, moetrain's fp32 CPU matmul kernel the one
``train.cpu_matmul: auto`` picks.

    .venv/bin/python benchmarks/qwen3_next_step.py --rounds 6
    .venv/bin/python benchmarks/qwen3_next_step.py --rounds 0 --profile linear   # op table

Each round times, moetrain then the peer: the whole step, then each block alone (forward and
backward of the module on the inputs the step gave it, against a fixed output gradient):
``linear`` (a Gated DeltaNet layer, the three summed), ``attention`` (the gated attention
layer), ``moe`` (the experts and the shared expert, four layers summed). Times are the
process's CPU time (less moved by other jobs on a shared machine than wall time). Printed: the
medians in ms and the peer / moetrain ratio per block (above 1: moetrain faster) with its range
over the rounds. ``--profile BLOCK`` (or ``step``) prints ``torch.profiler``'s op table (CPU
time, self and total) of that block's forward and backward on each side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step_sides import (  # noqa: E402
    compare_blocks,
    load_sides,
    moetrain_step,
    peer_step,
)

BLOCKS = ("linear", "attention", "moe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--profile", choices=("step", *BLOCKS), help="print this block's op table per side"
    )
    args = ap.parse_args()
    import torch

    from moetrain.model import cpu_matmul

    torch.set_num_threads(1)
    cpu_matmul.use_cpu_matmul(cpu_matmul.preferred_kernel())  # train.cpu_matmul: auto
    ours, peer, ids = load_sides("qwen3_next", attn_implementation="sdpa")

    linear = [spec.mixer.kind == "gated_deltanet" for spec in ours.plan]
    ours_mods = {
        "linear": [b.attn for b, lin in zip(ours.layers, linear, strict=True) if lin],
        "attention": [b.attn for b, lin in zip(ours.layers, linear, strict=True) if not lin],
        "moe": [b.ffn for b in ours.layers],
    }
    layers = peer.model.layers
    peer_mods = {
        "linear": [lay.linear_attn for lay in layers if hasattr(lay, "linear_attn")],
        "attention": [lay.self_attn for lay in layers if hasattr(lay, "self_attn")],
        "moe": [lay.mlp for lay in layers],
    }
    sides = {
        "moetrain": (ours, ours_mods, lambda: moetrain_step(ours, ids)),
        "peer": (peer, peer_mods, lambda: peer_step(peer, ids)),
    }
    compare_blocks(sides, BLOCKS, args.rounds, args.profile)


if __name__ == "__main__":
    main()
