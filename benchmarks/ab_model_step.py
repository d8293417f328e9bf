"""A/B of the single-device model's forward + backward between two checkouts (before / after a
change to the model code), in CPU time: the quiet complement of ``ab_checkouts.py``.

    .venv/bin/python benchmarks/ab_model_step.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 9]

Each round runs one child process per checkout (its ``moetrain`` first on ``sys.path``),
alternating which goes first. A child builds ``train_throughput.py``'s ``bench`` model (vocab
8192, d 256, 4 layers, 4 heads / 2 KV heads, 8 experts top-2 of hidden 512) on one thread and
times ``--steps`` forward + backward passes of the training loss (chunked, as the trainer
calls it) on 4 rows of 256 tokens of packed documents, after 2 warm-up passes, by the process's
CPU time (which other processes' load moves much less than wall time). Reported: each round's
median ms per pass for both, the paired ratios new / old, their median and range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = [
    "model.vocab_size=8192",
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.max_seq_len=256",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.expert_hidden=512",
    "data.seq_len=256",
]


def child(checkout: Path, steps: int) -> None:
    sys.path.insert(0, str(checkout))
    import torch

    from moetrain.config import apply_overrides, config_from_dict
    from moetrain.model import Transformer

    assert Path(sys.modules["moetrain"].__file__).is_relative_to(checkout)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = config_from_dict(apply_overrides({}, BENCH))
    model = Transformer(cfg.model, cfg.moe)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 256), generator=g)
    doc_ids = torch.cumsum(torch.rand(4, 256, generator=g) < 1 / 64, dim=1)
    times = []
    for i in range(2 + steps):
        t0 = time.process_time()
        out = model(ids, doc_ids_BS=doc_ids, labels_BS=ids, return_logits=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.process_time() - t0)
    print(json.dumps({"ms": 1e3 * statistics.median(times)}))


def run_once(checkout: Path, steps: int) -> float:
    cmd = [sys.executable, __file__, "--child", str(checkout), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}: {out.stdout[-2000:]}{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, nargs="?")
    ap.add_argument("new", type=Path, nargs="?")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child.resolve(), args.steps)
        return
    ratios = []
    for rnd in range(args.rounds):
        order = [("old", args.old), ("new", args.new)]
        if rnd % 2:
            order.reverse()
        ms = {name: run_once(path.resolve(), args.steps) for name, path in order}
        ratios.append(ms["old"] / ms["new"])  # > 1: the new code is faster
        print(
            f"round {rnd}: old {ms['old']:.1f} ms, new {ms['new']:.1f} ms, "
            f"speed new/old {ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"speed new/old: median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} paired rounds)"
    )


if __name__ == "__main__":
    main()
