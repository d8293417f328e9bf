"""Conversion benchmark: time and peak memory of ``convert_checkpoint`` on a ~100M-parameter
checkpoint, against the size of the largest streamed part; then KV-cache generation speed is
measured by benchmarks/generate.py on the converted directory.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/convert.py [--work DIR]

The checkpoint is written in the trainer's layout (dense file + one file per expert) from a
freshly initialised model (no training needed). Conversion runs in a child process so that its
peak RSS is its own: after imports it resets the kernel's high-water mark (``/proc/self/clear_refs``)
and reports RSS then (baseline) and ``VmHWM`` after converting (peak).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(vocab_size=32000, d_model=512, n_layers=6, n_heads=8, n_kv_heads=4, max_seq_len=512)
MOE = dict(num_experts=8, top_k=2, expert_hidden=1024)


def make_checkpoint(work: Path) -> Path:
    from moetrain.checkpoint.write import write_checkpoint
    from moetrain.config import Config, ModelConfig, MoEConfig
    from moetrain.data.tokenizer import train_tokenizer
    from moetrain.model import param_names
    from moetrain.model.transformer import Transformer

    ckpt = work / "checkpoints" / "step_00000000"
    if ckpt.exists():
        return ckpt
    text = [
        p.read_text(errors="replace") for p in sorted(Path(os.__file__).parent.glob("*.py"))[:40]
    ]
    tok = train_tokenizer(text, 2048, work / "tok")
    cfg = Config(model=ModelConfig(**MODEL), moe=MoEConfig(**MOE))
    torch.manual_seed(0)
    sd = Transformer(cfg.model, cfg.moe).state_dict()
    experts = [
        (
            f"layers.{i}",
            {k: v for k, v in sd.items() if k.startswith(param_names.experts_prefix(i))},
        )
        for i in range(cfg.model.n_layers)
    ]
    write_checkpoint(ckpt, cfg, [("dense", sd), *experts], tok.path)
    return ckpt


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def child(ckpt: str, out: str, dtype: str) -> None:
    import transformers  # noqa: F401  (imported by the conversion; part of the baseline)

    from moetrain.convert.export import convert_checkpoint

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    base = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    convert_checkpoint(ckpt, out, dtype=dtype, overwrite=True, max_shard_bytes=200 * 2**20)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _status_kib("VmHWM")
    print(
        json.dumps(
            {"wall_s": wall, "cpu_s": cpu, "rss_base_mib": base / 1024, "rss_peak_mib": peak / 1024}
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/bench-convert")
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    work = Path(args.work)
    ckpt = make_checkpoint(work)
    from moetrain.checkpoint.read import checkpoint_config, iter_layer_states

    cfg = checkpoint_config(ckpt)
    sizes = {
        w: sum(t.numel() * t.element_size() for t in p.values())
        for w, p in iter_layer_states(ckpt, cfg)
    }
    params = sum(sizes.values()) // 4
    dense, layer = sizes["dense"] / 2**20, max(v for k, v in sizes.items() if k != "dense") / 2**20
    print(
        f"checkpoint: {params / 1e6:.1f}M params, {sum(sizes.values()) / 2**20:.0f} MiB fp32; "
        f"dense part {dense:.0f} MiB, largest expert layer {layer:.0f} MiB"
    )
    for dtype in ("fp32", "bf16"):
        out = work / f"hf-{dtype}"
        res = subprocess.run(
            [sys.executable, __file__, "--child", str(ckpt), str(out), dtype],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        r = json.loads(res.stdout.strip().splitlines()[-1])
        extra = r["rss_peak_mib"] - r["rss_base_mib"]
        print(
            f"convert {dtype}: wall {r['wall_s']:.1f}s cpu {r['cpu_s']:.1f}s | peak RSS "
            f"{r['rss_peak_mib']:.0f} MiB = baseline {r['rss_base_mib']:.0f} + {extra:.0f} MiB "
            f"(dense {dense:.0f} + largest layer {layer:.0f} = {dense + layer:.0f} MiB; whole "
            f"model {sum(sizes.values()) / 2**20:.0f} MiB)"
        )


if __name__ == "__main__":
    main()
