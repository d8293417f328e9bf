"""``checkpoint.init_from`` load: time and peak RSS per rank of loading a ~1B-parameter Hugging
Face MoE directory (bf16 safetensors, generated locally) on 2 ranks at EP=2, side by side with
transformers' ``AutoModelForCausalLM.from_pretrained`` of the same directory.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/init_from.py [--work runs/bench-init-from] \
        [--rounds 2] [--keep]

The directory (Mixtral layout: vocab 32000, d 1024, 12 layers, 16 experts of hidden 1536, top-2;
1.01B parameters, 2.0 GB in bf16, 5 shards + index) is written under ``--work`` and deleted at
the end unless ``--keep``. Cases, each in fresh processes, interleaved round by round:

- ``moetrain``: 2 gloo ranks with the trainer's topology (EP=2); each rank builds the run's model
  from the directory as the Trainer does before ``deepspeed.initialize``
  (:func:`moetrain.init_from.weights.build_model` with its own experts): fp32 parameters (the
  trainer's), the dense weights and half of the experts.
- ``hf-bf16``: ``from_pretrained(dir)`` (the directory's dtype), one process, all cores.
- ``hf-fp32``: ``from_pretrained(dir, dtype=torch.float32)``: the trainer's dtype.

Each process resets the kernel's RSS high-water mark after its imports
(``/proc/self/clear_refs``) and reports the RSS then (baseline) and ``VmHWM`` after loading
(peak), and the load's wall time. Peaks include file pages mapped while reading (safetensors
memory-maps its files).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository: tests.helpers
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_local_experts=16,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    sliding_window=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
LAYERS_PER_SHARD = 3


def _tensors(layer: int | None) -> dict[str, tuple[int, ...]]:
    d, f, e = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_local_experts"]
    kv = d // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    if layer is None:
        v = SHAPE["vocab_size"]
        return {
            "model.embed_tokens.weight": (v, d),
            "lm_head.weight": (v, d),
            "model.norm.weight": (d,),
        }
    p = f"model.layers.{layer}."
    out = {
        p + "input_layernorm.weight": (d,),
        p + "post_attention_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (d, d),
        p + "self_attn.k_proj.weight": (kv, d),
        p + "self_attn.v_proj.weight": (kv, d),
        p + "self_attn.o_proj.weight": (d, d),
        p + "block_sparse_moe.gate.weight": (e, d),
    }
    for x in range(e):
        q = f"{p}block_sparse_moe.experts.{x}."
        out |= {q + "w1.weight": (f, d), q + "w3.weight": (f, d), q + "w2.weight": (d, f)}
    return out


def make_directory(out: Path) -> tuple[Path, int]:
    """Write the synthetic model (random bf16 weights, norms 1) one shard at a time."""
    import transformers
    from safetensors.torch import save_file

    if (out / "model.safetensors.index.json").is_file():
        index = json.loads((out / "model.safetensors.index.json").read_text())
        return out, index["metadata"]["total_size"] // 2
    out.mkdir(parents=True, exist_ok=True)
    transformers.MixtralConfig(**SHAPE, dtype="bfloat16").save_pretrained(out)
    groups = [[None]] + [
        list(range(i, min(i + LAYERS_PER_SHARD, SHAPE["num_hidden_layers"])))
        for i in range(0, SHAPE["num_hidden_layers"], LAYERS_PER_SHARD)
    ]
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, layers in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for layer in layers:
            for key, shape in _tensors(layer).items():
                t = (
                    torch.ones(shape)
                    if key.endswith("norm.weight")
                    else torch.randn(shape, generator=gen) * 0.02
                )
                shard[key] = t.to(torch.bfloat16)
                weight_map[key] = name
                total += t.numel() * 2
        save_file(shard, str(out / name), metadata={"format": "pt"})
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out, total // 2


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    return _status_kib("VmRSS")


def _measured(load) -> dict[str, float]:  # noqa: ANN001
    base = _reset_peak()
    t0 = time.perf_counter()
    model = load()
    wall = time.perf_counter() - t0
    n = sum(p.numel() for p in model.parameters())
    return {
        "wall_s": wall,
        "base_mib": base / 1024,
        "peak_mib": _status_kib("VmHWM") / 1024,
        "params": n,
    }


def moetrain_rank(rank: int, world: int, hf_dir: str) -> dict[str, float]:
    """One rank: the Trainer's model from ``hf_dir`` with this rank's experts (EP=2)."""
    from moetrain.config import read_config_data
    from moetrain.init_from.source import resolve_config_data
    from moetrain.init_from.weights import build_model
    from moetrain.parallel.topology import init_distributed

    overrides = [f"checkpoint.init_from={hf_dir}", "parallel.ep_size=2", "data.seq_len=256"]
    cfg, source = resolve_config_data(read_config_data(None, overrides))
    topo = init_distributed(cfg)
    local = topo.local_experts(cfg.moe.num_experts)
    return _measured(lambda: build_model(cfg, source, local))


def hf_child(hf_dir: str, dtype: str) -> None:
    import transformers

    kw = {"dtype": torch.float32} if dtype == "fp32" else {}
    auto = transformers.AutoModelForCausalLM
    print(json.dumps(_measured(lambda: auto.from_pretrained(hf_dir, **kw))))


def run_case(case: str, hf_dir: Path) -> list[dict[str, float]]:
    if case == "moetrain":
        from tests.helpers.distributed import run_distributed

        return run_distributed(moetrain_rank, 2, str(hf_dir), timeout=1800)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    res = subprocess.run(
        [sys.executable, __file__, "--hf-child", str(hf_dir), case.split("-")[1]],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    return [json.loads(res.stdout.strip().splitlines()[-1])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/bench-init-from")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=["moetrain", "hf-bf16", "hf-fp32"])
    ap.add_argument("--keep", action="store_true", help="keep the generated directory")
    ap.add_argument("--hf-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_child:
        hf_child(*args.hf_child)
        return
    work = Path(args.work)
    t0 = time.perf_counter()
    hf_dir, params = make_directory(work / "hf-moe-1b")
    print(
        f"directory: {params / 1e9:.2f}B parameters, {params * 2 / 2**30:.2f} GiB bf16 "
        f"({time.perf_counter() - t0:.0f}s to write)"
    )
    results: dict[str, list[dict[str, float]]] = {c: [] for c in args.cases}
    try:
        for r in range(args.rounds):
            for case in args.cases:
                for rank, res in enumerate(run_case(case, hf_dir)):
                    results[case].append(res)
                    print(
                        f"round {r} {case} rank {rank}: load {res['wall_s']:.1f}s, peak RSS "
                        f"{res['peak_mib']:.0f} MiB (baseline {res['base_mib']:.0f}, model "
                        f"{res['params'] / 1e6:.0f}M params)",
                        flush=True,
                    )
    finally:
        if not args.keep:
            shutil.rmtree(hf_dir, ignore_errors=True)
    summary = {
        c: {
            "wall_s": statistics.median(x["wall_s"] for x in rs),
            "peak_mib": max(x["peak_mib"] for x in rs),
            "added_mib": max(x["peak_mib"] - x["base_mib"] for x in rs),
        }
        for c, rs in results.items()
        if rs
    }
    print(json.dumps(summary, indent=2))
    if "moetrain" in summary:
        ours = summary["moetrain"]
        for peer in (c for c in summary if c != "moetrain"):
            theirs = summary[peer]
            print(
                f"moetrain / {peer}: load time {ours['wall_s'] / theirs['wall_s']:.2f}x, peak RSS "
                f"per rank {ours['peak_mib'] / theirs['peak_mib']:.2f}x, RSS added by the load "
                f"{ours['added_mib'] / theirs['added_mib']:.2f}x"
            )


if __name__ == "__main__":
    main()
