"""Multi-head latent attention against grouped-query attention at (nearly) equal parameters:
the generation cache's bytes per token and one attention block's training step time.

    .venv/bin/python benchmarks/mla_vs_gqa.py                  # S 1024, batch 4, 7 rounds
    .venv/bin/python benchmarks/mla_vs_gqa.py --seq 2048 --rounds 9

Shapes (d_model 512, 8 heads, fp32, one thread, CPU): GQA with 2 key/value heads of 64; MLA
with query / key heads of 32 + 32 (no RoPE / RoPE) dims, value heads of 64 and a KV latent of
96 (DeepSeek-V2-Lite's proportions, no query LoRA). Cache bytes per token are read off the
caches ``Transformer.new_cache`` builds (all layers of a 4-layer model, fp32). The step is the
block's norm + attention forward and backward on a packed batch with document masks; the two
kinds alternate within each round and the paired ratio MLA / GQA is reported (median and range
over rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.layer_plan import mixer_spec
from moetrain.model.doc_attention import Documents
from moetrain.model.layers import RMSNorm
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.rope import model_rope_tables
from moetrain.model.transformer import Transformer

COMMON = dict(vocab_size=4096, d_model=512, n_layers=4, n_heads=8, max_seq_len=4096)
KINDS = {
    "gqa": ModelConfig(**COMMON, n_kv_heads=2, head_dim=64),
    "mla": ModelConfig(
        **COMMON,
        n_kv_heads=8,
        attention="mla",
        kv_lora_rank=96,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
    ),
}


def block(cfg: ModelConfig) -> tuple[torch.nn.Module, RMSNorm]:
    torch.manual_seed(0)
    attn = build_mixer(cfg, mixer_spec(cfg, 0))
    return attn, RMSNorm(cfg.d_model)


def step_seconds(cfg: ModelConfig, x: torch.Tensor, docs: Documents, reps: int) -> float:
    attn, norm = block(cfg)
    cos, sin = model_rope_tables(cfg)
    s = x.shape[1]
    cos, sin = cos[:s], sin[:s]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        y = attn(norm(x), MixerInputs(cos, sin, docs))
        y.square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out: dict = {"seq": args.seq, "batch": args.batch}
    for kind, cfg in KINDS.items():
        attn, _ = block(cfg)
        with torch.device("meta"):
            model = Transformer(cfg, MoEConfig(first_k_dense=cfg.n_layers))
        cache = model.new_cache(1, 16)
        tensors = [t for state in cache.layers for t in vars(state).values()]
        measured = sum(t.numel() * t.element_size() for t in tensors) // 16
        out[kind] = {
            "attention_params": sum(p.numel() for p in attn.parameters()),
            "cache_bytes_per_token": measured,
            "cache_bytes_per_token_reported": cache.bytes_per_token,
        }
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, COMMON["d_model"], generator=g, requires_grad=True)
    lengths = torch.randint(64, 512, (args.batch, args.seq // 64), generator=g)
    ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), r)[: args.seq] for r in lengths]
    )
    docs = Documents.from_ids(ids)
    ratios, per_kind = [], {k: [] for k in KINDS}
    for r in range(args.rounds):
        order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))
        t = {k: step_seconds(KINDS[k], x, docs, args.reps) for k in order}
        for k in KINDS:
            per_kind[k].append(t[k])
        ratios.append(t["mla"] / t["gqa"])
    for k in KINDS:
        out[k]["step_ms_median"] = 1e3 * statistics.median(per_kind[k])
    out["step_ratio_mla_over_gqa"] = {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }
    out["cache_ratio_mla_over_gqa"] = (
        out["mla"]["cache_bytes_per_token"] / out["gqa"]["cache_bytes_per_token"]
    )
    out["params_ratio_mla_over_gqa"] = (
        out["mla"]["attention_params"] / out["gqa"]["attention_params"]
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
