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
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step_sides import load_sides, moetrain_step, peer_step  # noqa: E402

BLOCKS = ("linear", "attention", "moe")


def _first(out):  # noqa: ANN001, ANN202
    """A module's main output tensor (modules return tuples of it and statistics)."""
    return out[0] if isinstance(out, tuple) else out


class Captured:
    """A module's call as the step made it: its positional and keyword arguments, the floating
    tensors detached as fresh leaves, and a fixed gradient for its output."""

    def __init__(self, module, args: tuple, kwargs: dict, out) -> None:  # noqa: ANN001
        import torch

        def leaf(x):  # noqa: ANN001, ANN202
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
                return x.detach().requires_grad_(True)
            return x

        self.module, self.args = module, tuple(leaf(a) for a in args)
        self.kwargs = {k: leaf(v) for k, v in kwargs.items()}
        gen = torch.Generator().manual_seed(1)
        self.grad = torch.randn(_first(out).shape, generator=gen, dtype=_first(out).dtype)

    def run(self) -> None:
        _first(self.module(*self.args, **self.kwargs)).backward(self.grad)


def capture(model, modules: dict[str, list], step: Callable[[], float]) -> dict[str, list]:  # noqa: ANN001
    """Each named module's call in one step of ``step``."""
    calls: dict[str, list[Captured]] = {name: [] for name in modules}
    hooks = []
    for name, mods in modules.items():
        for m in mods:

            def hook(mod, args, kwargs, out, name=name) -> None:  # noqa: ANN001
                calls[name].append(Captured(mod, args, kwargs, out))

            hooks.append(m.register_forward_hook(hook, with_kwargs=True))
    step()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return calls


def cpu_ms(fn: Callable[[], object]) -> float:
    c = time.process_time()
    fn()
    return (time.process_time() - c) * 1e3


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
    print("first cross-entropy:", {k: round(s[2](), 7) for k, s in sides.items()})
    calls = {name: capture(*side) for name, side in sides.items()}
    for side_calls in calls.values():  # (warm-up)
        for cs in side_calls.values():
            for c in cs:
                c.run()
    if args.profile:
        steps = {name: side[2] for name, side in sides.items()}
        profile_block(calls, steps, args.profile)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, (model, _, step) in sides.items():
            times.setdefault((name, "step"), []).append(cpu_ms(step))
            model.zero_grad(set_to_none=True)
            for block, cs in calls[name].items():
                t = sum(cpu_ms(c.run) for c in cs)
                times.setdefault((name, block), []).append(t)
    if not args.rounds:
        return
    print(f"\nCPU ms per step, medians of {args.rounds} rounds; peer / moetrain per round")
    print("| block | moetrain | peer | peer / moetrain |")
    print("|---|---:|---:|---:|")
    for block in ("step", *BLOCKS):
        m, p = times["moetrain", block], times["peer", block]
        ratios = [b / a for a, b in zip(m, p, strict=True)]
        print(
            f"| {block} | {statistics.median(m):.1f} | {statistics.median(p):.1f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x) |"
        )


def profile_block(
    calls: dict[str, dict[str, list]], steps: dict[str, Callable[[], float]], block: str
) -> None:
    """The op table of ``block`` (or the whole ``step``) on each side, by self CPU time; for
    the step also by total CPU time (where the top-level ops' time goes)."""
    from torch.profiler import ProfilerActivity, profile

    for name, side_calls in calls.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if block == "step":
                steps[name]()
            else:
                for c in side_calls[block]:
                    c.run()
        print(f"\n{name}, {block}, forward and backward:")
        table = prof.key_averages().table
        print(table(sort_by="self_cpu_time_total", row_limit=30))
        if block == "step":
            print(table(sort_by="cpu_time_total", row_limit=40))


if __name__ == "__main__":
    main()
