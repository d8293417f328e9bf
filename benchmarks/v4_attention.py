"""DeepSeek-V4's token mixer alone (``model.attention: compressed``), forward + backward: moetrain
against transformers' ``DeepseekV4Attention`` (eager), and optionally against moetrain's own
attention at an earlier commit, on the calls one training step makes (``step_sides.py``: the
bench model of ``train_command.py --family deepseek_v4``, 4 x 256 tokens, its 4 layers: sliding,
csa, hca, csa), one thread, CPU time.

    .venv/bin/python benchmarks/v4_attention.py --rounds 9
    .venv/bin/python benchmarks/v4_attention.py --rounds 9 --baseline main

``--baseline REV``: ``moetrain/model/compressed_attention.py`` and ``compressed_kernel.py`` as
they are at git revision REV, loaded beside this checkout's (the rest of the package is this
checkout's), with this checkout's weights and inputs. Its outputs and input gradients are
compared with this checkout's first (the largest difference relative to the largest value).

Sides run in alternating order round by round; printed: each side's median CPU ms per step (its
4 calls) with the range, and the per-round ratios to moetrain (above 1: moetrain faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step_sides import (  # noqa: E402
    Captured,
    _first,
    capture,
    cpu_ms,
    load_sides,
    moetrain_step,
    peer_step,
)

FILES = ("compressed_kernel", "compressed_attention")


def baseline_attention(rev: str):  # noqa: ANN201
    """``CompressedAttention`` and ``CompressedAttentionShape`` of ``compressed_attention.py`` at
    ``rev``, its kernel the ``compressed_kernel.py`` of ``rev``."""
    import moetrain.model

    saved = {name: sys.modules[f"moetrain.model.{name}"] for name in FILES}
    tmp = Path(tempfile.mkdtemp())
    try:
        for name in FILES:
            source = subprocess.run(
                ["git", "show", f"{rev}:moetrain/model/{name}.py"],
                cwd=HERE.parent, capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            (tmp / f"{name}.py").write_text(source)
            spec = importlib.util.spec_from_file_location(f"baseline_{name}", tmp / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            sys.modules[f"moetrain.model.{name}"] = module  # (the next file imports it)
            setattr(moetrain.model, name, module)
            spec.loader.exec_module(module)
        return module.CompressedAttention, module.CompressedAttentionShape
    finally:
        for name, module in saved.items():
            sys.modules[f"moetrain.model.{name}"] = module
            setattr(moetrain.model, name, module)


def baseline_calls(rev: str, calls: list[Captured]) -> list[Captured]:
    """The captured calls of moetrain's mixers replayed by the attention of ``rev`` (same
    weights, inputs and output gradients)."""
    attention, shape = baseline_attention(rev)
    out = []
    for call in calls:
        mixer, x = call.module, call.args[0]
        module = attention(shape(**vars(mixer.shape)))
        module.load_state_dict(mixer.state_dict())
        cos, sin = mixer.rope_rows(x.shape[1], x.device)
        replay = Captured(module, (x, cos, sin), {}, call.grad)
        replay.grad = call.grad
        out.append(replay)
    return out


def largest_difference(ours: list[Captured], theirs: list[Captured]) -> float:
    """The largest difference of the two sides' outputs and input gradients, relative to the
    largest value of each."""
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        results = []
        for call in (a, b):
            x = call.args[0]
            x.grad = None
            out = _first(call.module(*call.args, **call.kwargs))
            out.backward(call.grad)
            results.append((out.detach(), x.grad))
            call.module.zero_grad(set_to_none=True)
        for mine, other in zip(*results, strict=True):
            worst = max(worst, ((mine - other).abs().max() / other.abs().max()).item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--baseline", metavar="REV", help="also time moetrain's attention at REV")
    args = ap.parse_args()
    import torch

    from moetrain.model import cpu_matmul

    torch.set_num_threads(1)
    cpu_matmul.use_cpu_matmul(cpu_matmul.preferred_kernel())  # train.cpu_matmul: auto
    ours, peer, ids = load_sides("deepseek_v4", attn_implementation="eager")
    mixers = [b.attn for b in ours.layers]
    calls = {
        "moetrain": capture(ours, {"a": mixers}, lambda: moetrain_step(ours, ids))["a"],
        "peer": capture(
            peer, {"a": [lay.self_attn for lay in peer.model.layers]}, lambda: peer_step(peer, ids)
        )["a"],
    }
    if args.baseline:
        calls[f"moetrain@{args.baseline}"] = baseline_calls(args.baseline, calls["moetrain"])
        diff = largest_difference(calls["moetrain"], calls[f"moetrain@{args.baseline}"])
        print(f"outputs and input gradients against {args.baseline}: largest difference {diff:.1e}")
    for side_calls in calls.values():  # (warm-up)
        for c in side_calls:
            c.run()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(sum(cpu_ms(c.run) for c in calls[name]))
            for c in calls[name]:
                c.module.zero_grad(set_to_none=True)
    print(f"\nCPU ms per step (4 layers, forward + backward), medians of {args.rounds} rounds")
    print("| side | ms (range) | side / moetrain (range) |")
    print("|---|---:|---:|")
    for name in names:
        t, ratios = (
            times[name],
            [a / b for a, b in zip(times[name], times["moetrain"], strict=True)],
        )
        print(
            f"| {name} | {statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x) |"
        )


if __name__ == "__main__":
    main()
