"""Causal attention forward+backward with a sliding window (:mod:`moetrain.model.local_attention`)
against full causal attention, peak memory and time side by side, with their ratios.

    .venv/bin/python benchmarks/sliding_window.py                   # S=4096, window 128
    .venv/bin/python benchmarks/sliding_window.py --seq-len 8192 --window 128 --sinks

One sequence, 8 query heads, 2 key/value heads, head dim 64, fp32, one thread, CPU (the same
setting as benchmarks/doc_attention.py). Each path runs in a fresh subprocess: one warm-up
pass, then the peak RSS of one fwd+bwd pass minus the RSS just before it (peak reset through
/proc/self/clear_refs; glibc serves allocations >= 64 KiB with mmap, so RSS follows live
tensors) and the median CPU time of ``--repeats`` passes. ``--sinks`` gives both paths
attention sinks (gpt-oss's layers: full layers with sinks against sliding ones with sinks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

H, G, HD = 8, 2, 64
PATHS = ("full", "sliding")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _child(path: str, s: int, window: int, sinks: bool, repeats: int) -> dict:
    import torch

    from moetrain.model.local_attention import local_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, s, HD, generator=g, requires_grad=True)
    k = torch.randn(1, G, s, HD, generator=g, requires_grad=True)
    v = torch.randn(1, G, s, HD, generator=g, requires_grad=True)
    sinks_H = torch.randn(H, generator=g, requires_grad=True) if sinks else None
    grad = torch.randn(1, H, s, HD, generator=g)
    w = window if path == "sliding" else None

    def step() -> None:
        local_attention(q, k, v, w, sinks_H, enable_gqa=True).backward(grad)
        q.grad = k.grad = v.grad = None
        if sinks_H is not None:
            sinks_H.grad = None

    step()
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kib("VmRSS")
    step()
    mib = (_rss_kib("VmHWM") - base) / 1024
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        step()
        times.append(time.process_time() - c0)
    return {"mib": mib, "ms": 1000 * statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = _child(args.child, args.seq_len, args.window, args.sinks, args.repeats)
        print("RESULT " + json.dumps(res))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    rows = {}
    for path in PATHS:
        cmd = [sys.executable, __file__, "--child", path, "--seq-len", str(args.seq_len)]
        cmd += ["--window", str(args.window), "--repeats", str(args.repeats)]
        cmd += ["--sinks"] if args.sinks else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"{path} failed:\n{proc.stderr[-3000:]}")
        rows[path] = json.loads(line[0][len("RESULT ") :])
        print(f"  {path:8s} {rows[path]}", file=sys.stderr)
    sinks = ", sinks" if args.sinks else ""
    print(
        f"\nfwd+bwd, 1 sequence, S={args.seq_len}, window {args.window}{sinks}, H={H} G={G} "
        f"Hd={HD}, fp32, 1 thread\n"
    )
    print("| path | extra peak RSS MiB | CPU ms (median) |")
    print("|---|---:|---:|")
    for path, r in rows.items():
        print(f"| {path} | {r['mib']:.1f} | {r['ms']:.1f} |")
    full, slid = rows["full"], rows["sliding"]
    print(f"| sliding / full | {slid['mib'] / full['mib']:.2f}x | {slid['ms'] / full['ms']:.2f}x |")


if __name__ == "__main__":
    main()
