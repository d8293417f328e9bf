"""DeepSeek sparse attention (``model.index_topk``) against dense latent attention and against
transformers' DeepseekV32Attention: one attention layer's training step (forward + backward)
time and peak memory as S grows, side by side, alternating.

    .venv/bin/python benchmarks/dsa.py          # S = 8k, 16k, 32k; top-k 256, 512, 2048
    .venv/bin/python benchmarks/dsa.py --seq-lens 8192 --topk 256 2048 --rounds 1

Paths: ``dsa`` is moetrain's latent attention with sparse attention in its sparse training stage
(the indexer selects each query's top-k keys block by block, attention runs over them in the
shared-key form, the indexer's KL over the selected keys is in the loss); ``mla`` is the same
layer dense (``model.index_topk`` unset: CPU flash attention); ``transformers`` is
DeepseekV32Attention with its indexer (SDPA with the (S, S) top-k mask it builds; its indexer
runs without gradient), measured where its (S, S) tensors fit (``--hf-max-seq``).

DeepSeek-V3.2's layer with its widths shrunk to run on 2 CPU cores: d_model 256, 4 heads,
q_lora_rank 128, kv_lora_rank 64, qk_nope 32, qk_rope 16, v_head 32, 4 indexer heads of 32;
batch 1, fp32, one thread. Each measurement runs in a fresh subprocess: with glibc serving
allocations >= 64 KiB by mmap (so that RSS follows live tensors), one warm-up step, then the
peak RSS of one step over the RSS just before it (peak reset through /proc/self/clear_refs),
then, with mmap for blocks of 32 MiB and more only and freed memory kept (every mmap costs a
path 1.5-3x in time), the median CPU time of ``--repeats`` steps. A round
runs every path of one S back to back, in alternating order from round to round; a figure is
the median over rounds. The load average is printed at the start and the end.
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

D, H, Q, C, N, R, V, HI, DI = 256, 4, 128, 64, 32, 16, 32, 4, 32
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _moetrain_step(s: int, topk: int | None):  # noqa: ANN202
    import torch

    from moetrain.config import ModelConfig
    from moetrain.config.layer_plan import mixer_spec
    from moetrain.model.mixers import MixerInputs, build_mixer
    from moetrain.model.rope import model_rope_tables

    keys = dict(vocab_size=64, d_model=D, n_layers=1, n_heads=H, n_kv_heads=H)
    keys.update(max_seq_len=s, attention="mla", q_lora_rank=Q, kv_lora_rank=C)
    keys.update(qk_nope_head_dim=N, qk_rope_head_dim=R, v_head_dim=V, rope_interleave=True)
    if topk is not None:
        keys.update(index_topk=topk, index_n_heads=HI, index_head_dim=DI, index_recall_queries=0)
    cfg = ModelConfig(**keys)
    cfg.validate()
    torch.manual_seed(0)
    attn = build_mixer(cfg, mixer_spec(cfg, 0)).train()
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0.0, 0.05)
    cos, sin = model_rope_tables(cfg, s)
    x = torch.randn(1, s, D, requires_grad=True)

    def step() -> None:
        inputs = MixerInputs(cos, sin)
        loss = attn(x, inputs).square().mean() + sum(own.loss for own in inputs.losses)
        loss.backward()
        attn.zero_grad(set_to_none=True)
        x.grad = None

    return step


def _transformers_step(s: int, topk: int):  # noqa: ANN202
    import torch
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    cfg = DeepseekV32Config(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=Q,
        kv_lora_rank=C,
        qk_nope_head_dim=N,
        qk_rope_head_dim=R,
        v_head_dim=V,
        index_topk=topk,
        index_n_heads=HI,
        index_head_dim=DI,
        max_position_embeddings=s,
        num_hidden_layers=1,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = hf.DeepseekV32Attention(cfg, 0).train()
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0.0, 0.05)
    rotary = hf.DeepseekV32RotaryEmbedding(cfg)
    x = torch.randn(1, s, D, requires_grad=True)
    pos = torch.arange(s)[None]
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]

    def step() -> None:
        out, _ = attn(x, rotary(x, pos), mask, position_ids=pos)
        out.square().mean().backward()
        attn.zero_grad(set_to_none=True)
        x.grad = None

    return step


def _child(path: str, s: int, topk: int, repeats: int) -> dict:
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, 65536)
    import torch

    torch.set_num_threads(1)
    if path == "transformers":
        step = _transformers_step(s, topk)
    else:
        step = _moetrain_step(s, topk if path == "dsa" else None)
    step()
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kib("VmRSS")
    step()
    mib = (_rss_kib("VmHWM") - base) / 1024
    # time: glibc's usual large-block threshold again (mmap per block costs 1.5-3x), freed
    # memory kept for reuse
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 40)
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        step()
        times.append(time.process_time() - c0)
    return {"mib": mib, "s": statistics.median(times)}


def _run(path: str, s: int, topk: int, repeats: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, __file__, "--child", path, "--seq-lens", str(s)]
    cmd += ["--topk", str(topk), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{path} at S={s}, k={topk} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--topk", type=int, nargs="+", default=[256, 512, 2048])
    ap.add_argument("--hf-topk", type=int, default=2048, help="transformers' index_topk")
    ap.add_argument("--hf-max-seq", type=int, default=8192, help="longest S for transformers")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = _child(args.child, args.seq_lens[0], args.topk[0], args.repeats)
        print("RESULT " + json.dumps(res))
        return
    print(f"load average at the start: {os.getloadavg()}", file=sys.stderr)
    cases = [("mla", 0), *(("dsa", k) for k in args.topk)]
    results: dict[tuple[str, int, int], list[dict]] = {}
    for s in args.seq_lens:
        here = cases + ([("transformers", args.hf_topk)] if s <= args.hf_max_seq else [])
        for r in range(args.rounds):
            for path, k in here if r % 2 == 0 else here[::-1]:
                res = _run(path, s, k, args.repeats)
                results.setdefault((path, k, s), []).append(res)
                print(f"  S={s} round {r} {path} k={k}: {res}", file=sys.stderr)
    print(f"load average at the end: {os.getloadavg()}", file=sys.stderr)
    print(
        f"\none layer fwd+bwd, batch 1, d {D}, {H} heads, q_lora {Q}, kv_lora {C}, qk {N}+{R}, "
        f"v {V}, indexer {HI} heads of {DI}, fp32, 1 thread; median of {args.rounds} "
        "alternating rounds\n"
    )
    header = "| S | " + " | ".join(f"{p} k={k}" if p != "mla" else "dense MLA" for p, k in cases)
    print(header + f" | transformers k={args.hf_topk} |")
    print("|---|" + "---:|" * (len(cases) + 1))
    for key, unit in (("s", "s"), ("mib", "MiB")):
        for s in args.seq_lens:
            row = []
            for p, k in [*cases, ("transformers", args.hf_topk)]:
                runs = results.get((p, k, s))
                row.append(f"{statistics.median(x[key] for x in runs):.1f}" if runs else "-")
            print(f"| {s} ({unit}) | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
