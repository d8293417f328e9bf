"""A/B between two checkouts of what DeepSeek-V4's step runs outside its blocks: the LM head with
its cross-entropy (plain, as ``v4_step.py`` calls the model, and chunked, as the trainer does),
the RMSNorms and the weightless RMS norm of the hyper-connections; and the whole step both ways.

    .venv/bin/python benchmarks/step_rest_ab.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 5]

Each round runs one child process per checkout (its ``moetrain`` first on ``sys.path``),
alternating which goes first. A child loads moetrain's model of ``v4_step.py`` (the bench-size
source model of ``train_command.py --family deepseek_v4``, the batch of 4 x 256 tokens), one
thread, torch's kernels (``train.cpu_matmul: auto`` on an AVX2 CPU), and times by the process's
CPU time, median of ``--repeats`` after a warm-up, forward + backward of:

- ``step plain`` / ``step chunked``: the whole step with the full logits' loss (``v4_step.py``'s)
  or the chunked loss (``return_logits=False``, the trainer's);
- ``head+loss plain`` / ``head+loss chunked``: the LM head and the loss alone on the step's final
  hidden state (1024 x 256, vocab 8192);
- ``rmsnorms``: every RMSNorm module's calls of one step (captured and replayed);
- ``unit_rms``: the weightless norm on a (4, 256, 1024) input (a hyper-connection's 4 streams).

Reported per case: each round's old and new medians, the paired ratios old / new (above 1: the
new code is faster), their median and range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = (
    "step plain",
    "step chunked",
    "head+loss plain",
    "head+loss chunked",
    "rmsnorms",
    "unit_rms",
)


def child(checkout: Path, repeats: int) -> None:
    sys.path.insert(0, str(checkout))
    sys.path.insert(1, str(HERE))
    import torch
    from family_source import save_family_source
    from step_sides import RUNS, capture

    from moetrain.convert.importer import load_hf_state_dict
    from moetrain.model import RMSNorm, Transformer, cpu_matmul
    from moetrain.model.attention import unit_rms

    assert Path(sys.modules["moetrain"].__file__).is_relative_to(checkout)
    torch.set_num_threads(1)
    cpu_matmul.use_cpu_matmul(cpu_matmul.preferred_kernel())
    state, cfg = load_hf_state_dict(save_family_source("deepseek_v4", RUNS / "family-deepseek_v4"))
    model = Transformer(cfg.model, cfg.moe)
    model.load_state_dict(state, strict=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 257), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step(return_logits: bool) -> None:
        model(inputs, labels_BS=labels, return_logits=return_logits).loss.backward()
        model.zero_grad(set_to_none=True)

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    calls = capture(model, {"norms": norms}, lambda: step(True))["norms"]
    h_BSD = torch.randn(4, 256, cfg.model.d_model, generator=g).requires_grad_()
    head, chunk = model.lm_head, cfg.model.loss_chunk_tokens
    streams = torch.randn(4, 256, 4 * cfg.model.d_model, generator=g).requires_grad_()
    streams_grad = torch.randn(streams.shape, generator=g)

    def head_plain() -> None:
        model._cross_entropy(h_BSD, labels, model.head(h_BSD)).backward()

    def head_chunked() -> None:
        head(h_BSD.flatten(0, 1), labels.flatten(), chunk).backward()

    cases = {
        "step plain": lambda: step(True),
        "step chunked": lambda: step(False),
        "head+loss plain": head_plain,
        "head+loss chunked": head_chunked,
        "rmsnorms": lambda: [c.run() for c in calls],
        "unit_rms": lambda: unit_rms(streams, 1e-6).backward(streams_grad),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(1 + repeats):
        for name, fn in cases.items():
            c = time.process_time()
            fn()
            if i:
                times[name].append((time.process_time() - c) * 1e3)
            model.zero_grad(set_to_none=True)
            h_BSD.grad = streams.grad = None
    print(json.dumps({name: statistics.median(t) for name, t in times.items()}))


def run_once(checkout: Path, repeats: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(checkout), "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}: {out.stdout[-2000:]}{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, nargs="?")
    ap.add_argument("new", type=Path, nargs="?")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child.resolve(), args.repeats)
        return
    if args.old is None or args.new is None:
        ap.error("give the OLD and NEW checkouts")
    ms: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for rnd in range(args.rounds):
        order = [("old", args.old), ("new", args.new)]
        if rnd % 2:
            order.reverse()
        for name, path in order:
            for case, value in run_once(path.resolve(), args.repeats).items():
                ms[name].setdefault(case, []).append(value)
        row = ", ".join(f"{c} {ms['old'][c][-1]:.1f} / {ms['new'][c][-1]:.1f}" for c in CASES)
        print(f"round {rnd} (old / new ms): {row}", flush=True)
    print(f"\nCPU ms, medians of {args.rounds} rounds; old / new per round (> 1: new faster)")
    print("| case | old | new | old / new |")
    print("|---|---:|---:|---:|")
    for case in CASES:
        old, new = ms["old"][case], ms["new"][case]
        ratios = [a / b for a, b in zip(old, new, strict=True)]
        print(
            f"| {case} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x) |"
        )


if __name__ == "__main__":
    main()
