"""Document-masked attention forward+backward: the dense (B, 1, S, S) mask against the
per-document path (:mod:`moetrain.model.doc_attention`), memory and time at two lengths.

    .venv/bin/python benchmarks/doc_attention.py                    # S in {4096, 8192}
    .venv/bin/python benchmarks/doc_attention.py --lengths 2048 4096 8192 --doc-tokens 512

One sequence of documents of ``--doc-tokens`` tokens on average (lengths drawn uniformly from
1 to twice that, seed 0), 8 query heads, 2 key/value heads, head dim 64, fp32, one thread, CPU.
Each (path, S) runs in a fresh subprocess: one warm-up pass, then the peak RSS of one
fwd+bwd pass minus the RSS just before it (the peak reset through /proc/self/clear_refs; glibc
serves every allocation >= 64 KiB with mmap, so RSS follows live tensors), and the median CPU
time of ``--repeats`` passes. Reported: MiB and ms per path and S, and each path's growth from
the shortest S (linear memory doubles with S; an S x S mask quadruples).
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
PATHS = ("dense-mask", "documents")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _child(path: str, s: int, doc_tokens: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from moetrain.model.attention import document_mask
    from moetrain.model.doc_attention import Documents, document_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < s:
        n = int(torch.randint(1, 2 * doc_tokens + 1, (1,), generator=g))
        lengths.append(min(n, s - total))
        total += lengths[-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    q = torch.randn(1, H, s, HD, generator=g, requires_grad=True)
    k = torch.randn(1, G, s, HD, generator=g, requires_grad=True)
    v = torch.randn(1, G, s, HD, generator=g, requires_grad=True)
    grad = torch.randn(1, H, s, HD, generator=g)

    def step() -> None:
        if path == "dense-mask":
            mask = document_mask(ids, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            out = document_attention(q, k, v, Documents.from_ids(ids), enable_gqa=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

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
    return {"mib": mib, "ms": 1000 * statistics.median(times), "documents": len(lengths)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("PATH", "S"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = _child(args.child[0], int(args.child[1]), args.doc_tokens, args.repeats)
        print("RESULT " + json.dumps(res))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    rows = {}
    for path in PATHS:
        for s in args.lengths:
            cmd = [sys.executable, __file__, "--child", path, str(s)]
            cmd += ["--doc-tokens", str(args.doc_tokens), "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                raise RuntimeError(f"{path} S={s} failed:\n{proc.stderr[-3000:]}")
            rows[path, s] = json.loads(line[0][len("RESULT ") :])
            print(f"  {path:10s} S={s:6d} {rows[path, s]}", file=sys.stderr)
    print(
        f"\nfwd+bwd, 1 sequence, ~{args.doc_tokens}-token documents, H={H} G={G} Hd={HD}, "
        "fp32, 1 thread\n"
    )
    print("| path | S | documents | extra peak RSS MiB | x shortest S | CPU ms (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    s0 = args.lengths[0]
    for (path, s), r in rows.items():
        growth = r["mib"] / rows[path, s0]["mib"]
        print(
            f"| {path} | {s} | {r['documents']} | {r['mib']:.1f} | {growth:.2f} | {r['ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
