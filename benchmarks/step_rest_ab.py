"""A/B of what DeepSeek-V4's step runs outside its blocks, old code against new in one process:
the LM head with its cross-entropy (plain, as ``v4_step.py`` calls the model, and chunked, as the
trainer does), the RMSNorms and the weightless RMS norm of the hyper-connections; and the whole
step both ways.

    .venv/bin/python benchmarks/step_rest_ab.py OLD_CHECKOUT [--rounds 7]

The old code is ``moetrain/model/{loss,layers,attention}.py`` of ``OLD_CHECKOUT`` loaded by path
(each imports only modules both checkouts share), swapped in for this checkout's
``ChunkedLinearCrossEntropy``, the RMSNorm function and ``unit_rms`` (the full logits' loss is
``F.cross_entropy`` on both sides). Each round runs every case old and
new back to back (which goes first alternating by round) on one model: moetrain's of
``v4_step.py`` (the bench-size source model of ``train_command.py --family deepseek_v4``, a
batch of 4 x 256 tokens), one thread, ``train.cpu_matmul: auto``. Each case is timed by the
process's CPU time, forward + backward:

- ``step plain`` / ``step chunked``: the whole step with the full logits' loss (``v4_step.py``'s)
  or the chunked loss (``return_logits=False``, the trainer's);
- ``head+loss plain`` / ``head+loss chunked``: the final norm's output through the LM head and
  the loss alone (1024 x 256, vocab 8192);
- ``rmsnorms``: every RMSNorm module's calls of one step (captured and replayed);
- ``unit_rms``: the weightless norm on a (4, 256, 1024) input (a hyper-connection's 4 streams).

Printed: both sides' first cross-entropy, then per case the medians and the paired ratios old /
new per round (above 1: the new code is faster), their median and range.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step_sides import capture, load_sides  # noqa: E402


def _module_at(path: Path, name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def old_and_new(old_checkout: Path) -> dict[str, list[tuple[object, str, object]]]:
    """Per side, the (module, attribute, value) settings that select its code."""
    from moetrain.model import compressed_attention, hyper_connections, layers, loss
    from moetrain.model.mixers import gqa

    src = old_checkout / "moetrain" / "model"
    old = {n: _module_at(src / f"{n}.py", f"old_{n}") for n in ("loss", "layers", "attention")}

    slots = [
        (loss, "ChunkedLinearCrossEntropy", old["loss"].ChunkedLinearCrossEntropy),
        (layers, "_RMSNormFunction", old["layers"]._RMSNormFunction),
        *((m, "unit_rms", old["attention"].unit_rms) for m in (hyper_connections, gqa)),
        (compressed_attention, "unit_rms", old["attention"].unit_rms),
    ]
    return {
        "old": [(m, a, v) for m, a, v in slots],
        "new": [(m, a, getattr(m, a)) for m, a, _ in slots],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the checkout of the old code")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch

    from moetrain.model import RMSNorm, cpu_matmul, hyper_connections

    torch.set_num_threads(1)
    cpu_matmul.use_cpu_matmul(cpu_matmul.preferred_kernel())
    sides = old_and_new(args.old.resolve())
    model, peer, ids = load_sides("deepseek_v4", attn_implementation="eager")
    del peer
    cfg = model.cfg
    inputs, labels = ids[:, :-1], ids[:, 1:]
    g = torch.Generator().manual_seed(0)

    def step(return_logits: bool) -> float:
        out = model(inputs, labels_BS=labels, return_logits=return_logits)
        out.loss.backward()
        return out.ce_loss.item()

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    calls = capture(model, {"norms": norms, "head": [model.lm_head]}, lambda: step(True))
    h_BSD = calls["head"][0].args[0]  # the final norm's output (a fresh leaf)
    streams = torch.randn(4, 256, 4 * cfg.d_model, generator=g).requires_grad_()
    streams_grad = torch.randn(streams.shape, generator=g)

    cases: dict[str, Callable[[], object]] = {
        "step plain": lambda: step(True),
        "step chunked": lambda: step(False),
        "head+loss plain": lambda: model._cross_entropy(
            h_BSD, labels, model.head(h_BSD)
        ).backward(),
        "head+loss chunked": lambda: model.lm_head(
            h_BSD.flatten(0, 1), labels.flatten(), cfg.loss_chunk_tokens
        ).backward(),
        "rmsnorms": lambda: [c.run() for c in calls["norms"]],
        "unit_rms": lambda: hyper_connections.unit_rms(streams, 1e-6).backward(streams_grad),
    }

    def use(side: str) -> None:
        for module, attr, value in sides[side]:
            setattr(module, attr, value)

    first = {}
    for side in sides:  # (warm-up)
        use(side)
        first[side] = step(True), step(False)
        for fn in cases.values():
            fn()
        model.zero_grad(set_to_none=True)
    print("first cross-entropy (plain, chunked):", first)
    ms: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for case, fn in cases.items():
            for side in list(sides) if rnd % 2 == 0 else list(sides)[::-1]:
                use(side)
                c = time.process_time()
                fn()
                ms.setdefault((side, case), []).append((time.process_time() - c) * 1e3)
                model.zero_grad(set_to_none=True)
                h_BSD.grad = streams.grad = None
    use("new")
    print(f"\nCPU ms, medians of {args.rounds} rounds; old / new per round (> 1: new faster)")
    print("| case | old | new | old / new |")
    print("|---|---:|---:|---:|")
    for case in cases:
        old, new = ms["old", case], ms["new", case]
        ratios = [a / b for a, b in zip(old, new, strict=True)]
        print(
            f"| {case} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x) |"
        )


if __name__ == "__main__":
    main()
