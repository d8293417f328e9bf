"""A hybrid model (Qwen3-Next's pattern: three Gated DeltaNet layers, then one full-attention
layer) against a full-attention model of equal parameters (within 2%: the same blocks with
attention in every layer): forward + backward time and peak memory of one training micro-batch
at each sequence length, side by side, alternating.

    .venv/bin/python benchmarks/hybrid_vs_attention.py                    # S = 4096 and 16384
    .venv/bin/python benchmarks/hybrid_vs_attention.py --seq-lens 4096 --rounds 3

Both models: 4 layers, d_model 256, 4 query heads and 2 key/value heads of 64 (causal SDPA over
the whole row), 4 experts top-2 of hidden 256, vocabulary 4096, batch 1, fp32, one thread, CPU.
The hybrid's linear layers: 2 query/key heads of 64 and 4 value heads of 44 (Qwen's 1 : 2
grouping), which gives the mixer the attention layer's parameters within 2%. Each measurement
runs in a fresh subprocess, as in ``benchmarks/gated_delta.py``: one warm-up step, the peak RSS
of one step over the RSS before it, then the median CPU time of ``--repeats`` steps under
``moetrain train``'s allocator setting. Ratios are the median over rounds of each round's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from side_by_side import alternating_rounds, print_table

MODELS = ("hybrid", "attention")
_M_MMAP_THRESHOLD = -3
SHAPE = {
    "model.vocab_size": 4096,
    "model.d_model": 256,
    "model.n_layers": 4,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.head_dim": 64,
    "model.dense_hidden": 256,
    "moe.num_experts": 4,
    "moe.top_k": 2,
    "moe.expert_hidden": 256,
}
HYBRID = {
    "model.full_attention_interval": 4,
    "model.linear_num_key_heads": 2,
    "model.linear_num_value_heads": 4,
    "model.linear_key_head_dim": 64,
    "model.linear_value_head_dim": 44,
}


def build(model: str, s: int):
    """The model's config at sequence length ``s``."""
    from moetrain.config import load_config

    settings = {**SHAPE, "model.max_seq_len": s, "data.seq_len": s}
    if model == "hybrid":
        settings |= HYBRID
    return load_config(None, [f"{k}={v}" for k, v in settings.items()])


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _child(model: str, s: int, repeats: int) -> dict:
    ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 65536)
    import torch

    from moetrain.model.transformer import Transformer
    from moetrain.train.host_allocator import tune_host_allocator

    torch.set_num_threads(1)
    cfg = build(model, s)
    torch.manual_seed(0)
    net = Transformer(cfg.model, cfg.moe)
    params = sum(p.numel() for p in net.parameters())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (1, s + 1), generator=gen)

    def step() -> None:
        net(ids[:, :-1], None, ids[:, 1:]).loss.backward()
        net.zero_grad(set_to_none=True)

    step()
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kib("VmRSS")
    step()
    mib = (_rss_kib("VmHWM") - base) / 1024
    tune_host_allocator("keep")
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        step()
        times.append(time.process_time() - c0)
    return {"mib": mib, "s": statistics.median(times), "params": params}


def _run(model: str, s: int, repeats: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, __file__, "--child", model, "--seq-lens", str(s)]
    cmd += ["--repeats", str(repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{model} at S={s} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args.seq_lens[0], args.repeats)))
        return
    rows = alternating_rounds(
        MODELS, args.seq_lens, args.rounds, lambda n, s: _run(n, s, args.repeats)
    )
    hyb, att = (rows[0][1][m][0]["params"] for m in MODELS)
    print(
        f"\nfwd+bwd of one row, hybrid {hyb / 1e6:.2f}M parameters, attention {att / 1e6:.2f}M, "
        f"fp32, 1 thread; {args.rounds} alternating rounds, median of {args.repeats} steps each\n"
    )
    print_table(rows, MODELS)


if __name__ == "__main__":
    main()
