"""Training throughput: moetrain vs Hugging Face MixtralForCausalLM, both through DeepSpeed ZeRO-2.

    .venv/bin/python benchmarks/train_throughput.py              # 2 CPU ranks, gloo
    .venv/bin/python benchmarks/train_throughput.py --steps 6 --warmup 2
    .venv/bin/python benchmarks/train_throughput.py --cases moetrain --set model.loss_chunk_tokens=0
    .venv/bin/python benchmarks/train_throughput.py --shape vocab32k   # another shape (below)
    .venv/bin/python benchmarks/train_throughput.py --shape shared --cases moetrain hf-qwen2-moe
    .venv/bin/python benchmarks/train_throughput.py --world 1 --cases moetrain-ep1 hf-mixtral

Same shape for every case. ``--shape bench`` (the default, the targets'
shape): vocab 8192, d 256, 4 layers, 4 heads, 2 kv heads, 8 experts, top-2, expert hidden
512, seq 256, micro-batch 4 per rank, fp32, AdamW, clipping 1.0, aux loss 0.01, one thread per
rank, 2 ranks. Other shapes change only what their name says, keeping the active FLOPs of the
experts: ``vocab32k`` Mixtral's 32000-token vocabulary; ``fine`` fine-grained experts as in
OLMoE / Qwen-MoE (64 experts, top-8, expert hidden 128); ``shared`` adds one gated shared
expert of hidden 512 (Qwen2-MoE style; moetrain computes it while the all-to-alls are in flight,
``--set moe.shared_expert_overlap=false`` turns that off). Cases (each in its own fresh pair of
processes):

- ``moetrain``       moetrain's Trainer (EP=2: each rank holds 4 experts; ZeRO-2 over the rest)
- ``moetrain-ep1``   the same with EP=1 (experts replicated; ZeRO-2 shards their optimizer state)
- ``hf-mixtral``     MixtralForCausalLM (default experts), ``deepspeed.initialize`` ZeRO-2
- ``hf-mixtral-grouped``  the same with ``experts_implementation="grouped_mm"``
- ``hf-mixtral-cpu-buckets``  ``hf-mixtral`` with moetrain's CPU ZeRO bucket size (2M elements;
  DeepSpeed's default is 500M): the same DeepSpeed settings on both sides
- ``hf-qwen2-moe``, ``hf-qwen2-moe-cpu-buckets``  the same with Qwen2MoeForCausalLM (the peer
  for ``--shape shared``: Mixtral has no shared expert; q/k/v biases off, top-k renormalised)

Tokens/s: global tokens per optimizer step / median step time over ``--steps`` measured steps
after ``--warmup``; the cases alternate round by round (``--rounds``) so that load from other
processes hits them alike. Reported: each case's best round, and each round's moetrain /
HF-peer ratio with their median (the peer: hf-mixtral, or hf-qwen2-moe with ``--shape
shared``). Memory: peak resident set size of each rank (``ru_maxrss``) and its growth over the
RSS measured just before the model is built (the part the training state accounts for; imports
excluded), max over ranks.

``--world 1`` runs each case in one process with the same micro-batch: its step with nothing to
exchange and no other rank to wait for, the compute a rank of the 2-rank run cannot go below
(its ratios pair moetrain-ep1 with the peer).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

SHAPE = dict(
    vocab=8192, d=256, layers=4, heads=4, kv_heads=2, experts=8, top_k=2, hidden=512, seq=256
)
SHAPES = {
    "bench": SHAPE,
    "vocab32k": {**SHAPE, "vocab": 32000},
    "fine": {**SHAPE, "experts": 64, "top_k": 8, "hidden": 128},
    "shared": {**SHAPE, "shared_hidden": 512},
    # DeepSeek-V3's architecture at this size: latent attention with a query LoRA, sigmoid
    # routing in 4 groups (2 per token), an ungated shared expert, the first layer dense
    "deepseek_v3": {
        **SHAPE,
        "kv_heads": SHAPE["heads"],
        "mla": dict(
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
        ),
        "groups": (4, 2),
    },
    # gpt-oss's architecture at this size: attention sinks, sliding-window (128) and full layers
    # alternating, biases on q/k/v/o, YaRN without truncation, a router with a bias taking top-k
    # on its logits then softmax over the k, experts with biases and the clamped SwiGLU
    "gpt_oss": {**SHAPE, "gpt_oss": dict(window=128, rope_theta=150000.0, yarn=(4.0, 64))},
}
MICRO = 4
LR = 3e-4  # AdamW's learning rate on every side (moetrain's default), constant, no warm-up
CASES = ["moetrain", "moetrain-ep1", "hf-mixtral", "hf-mixtral-grouped", "hf-mixtral-cpu-buckets"]
PEER_CASES = ["hf-qwen2-moe", "hf-qwen2-moe-cpu-buckets"]


def _rss_now_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batches(rank: int, world: int, n: int, shape: dict = SHAPE):
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        seq = torch.randint(0, shape["vocab"], (MICRO * world, shape["seq"] + 1), generator=g)
        mine = seq[rank * MICRO : (rank + 1) * MICRO]
        out.append({"input_ids": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous()})
    return out


def moetrain_trainer(ep: int, overrides: list[str], shape: dict = SHAPE):
    """moetrain's Trainer at ``shape`` (call inside an initialised process group), in a process
    set up as ``moetrain train`` sets up its own (CPU matmul kernel, glibc's allocator)."""
    from moetrain.config import load_config
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.loop import set_up_process
    from moetrain.train.trainer import Trainer

    s = shape
    cfg = load_config(
        None,
        [
            f"model.vocab_size={s['vocab']}",
            f"model.d_model={s['d']}",
            f"model.n_layers={s['layers']}",
            f"model.n_heads={s['heads']}",
            f"model.n_kv_heads={s['kv_heads']}",
            f"model.max_seq_len={s['seq']}",
            f"moe.num_experts={s['experts']}",
            f"moe.top_k={s['top_k']}",
            f"moe.expert_hidden={s['hidden']}",
            "moe.aux_loss_coef=0.01",
            "moe.z_loss_coef=0",
            f"data.seq_len={s['seq']}",
            f"parallel.ep_size={ep}",
            "parallel.zero_stage=2",
            f"train.micro_batch_size={MICRO}",
            "train.precision=fp32",
            f"optim.lr={LR}",
            "optim.grad_clip=1.0",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            "run_dir=runs/bench-unused",  # nothing is written there
            *architecture_overrides(s),
            *overrides,
        ],
    )
    set_up_process(cfg)
    return Trainer(cfg, init_distributed(cfg))


def gpt_oss_layer_types(layers: int) -> list[str]:
    """gpt-oss's layer pattern: sliding-window and full attention alternating."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def peer_family(shape: dict) -> str:
    """The Hugging Face class that trains the same architecture as ``shape``."""
    if "mla" in shape:
        return "deepseek-v3"
    if "gpt_oss" in shape:
        return "gpt-oss"
    return "qwen2-moe" if "shared_hidden" in shape else "mixtral"


def architecture_overrides(shape: dict) -> list[str]:
    """moetrain's settings for the shape's architecture beyond its sizes: a shared expert,
    DeepSeek-V3's attention and routing (no balancing loss, as transformers' DeepseekV3 has
    none; the selection bias moves) or gpt-oss's pieces."""
    if "gpt_oss" in shape:
        g = shape["gpt_oss"]
        factor, original = g["yarn"]
        return [
            "model.attention_sinks=true",
            "model.qkv_bias=true",
            "model.o_bias=true",
            f"model.sliding_window={g['window']}",
            f"model.layer_types=[{','.join(gpt_oss_layer_types(shape['layers']))}]",
            f"model.rope_theta={g['rope_theta']}",
            "model.rope_scaling=yarn",
            f"model.rope_factor={factor}",
            f"model.rope_original_max_seq_len={original}",
            "model.rope_truncate=false",
            "moe.router_bias=true",
            "moe.expert_biases=true",
            "moe.activation=clamped_swiglu",
            "moe.swiglu_alpha=1.702",  # transformers' GptOss defaults (and the release's)
            "moe.swiglu_limit=7.0",
            "moe.topk_before_score=true",
        ]
    if "mla" in shape:
        n_group, topk_group = shape["groups"]
        mla = [f"model.{k}={v}" for k, v in shape["mla"].items()]
        return [
            "model.attention=mla",
            *mla,
            "model.rope_interleave=true",
            "moe.score_func=sigmoid",
            f"moe.n_group={n_group}",
            f"moe.topk_group={topk_group}",
            "moe.num_shared_experts=1",
            "moe.first_k_dense=1",
            "moe.route_scale=2.5",
            "moe.bias_update_rate=0.001",
            "moe.aux_loss_coef=0",
            "moe.z_loss_coef=0",
        ]
    if "shared_hidden" not in shape:
        return []
    return [
        "moe.num_shared_experts=1",
        f"moe.shared_expert_hidden={shape['shared_hidden']}",
        "moe.shared_expert_gate=true",
    ]


def _moetrain_step_fn(ep: int, overrides: list[str], shape: dict):
    trainer = moetrain_trainer(ep, overrides, shape)
    return lambda batch: trainer.train_step([batch])


def peer_ds_config(small_buckets: bool) -> dict:
    """The Hugging Face peers' DeepSpeed config: ZeRO-2, clipping 1.0, one micro-batch per step;
    ``small_buckets``: moetrain's CPU bucket sizes instead of DeepSpeed's defaults."""
    from moetrain.config.sections import CPU_BUCKET_ELEMENTS

    zero = {"stage": 2, "contiguous_gradients": True, "overlap_comm": False}
    if small_buckets:
        zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = CPU_BUCKET_ELEMENTS
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def _hf_model(family: str, grouped: bool, shape: dict):
    import transformers

    s = shape
    common = dict(
        vocab_size=s["vocab"],
        hidden_size=s["d"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        num_experts_per_tok=s["top_k"],
        max_position_embeddings=s["seq"],
        router_aux_loss_coef=0.01,
        output_router_logits=True,
        attn_implementation="sdpa",
        use_cache=False,
    )
    if grouped:
        common["experts_implementation"] = "grouped_mm"
    if family == "deepseek-v3":
        common.pop("router_aux_loss_coef"), common.pop("output_router_logits")
        n_group, topk_group = s["groups"]
        config = transformers.DeepseekV3Config(
            **common,
            **s["mla"],
            intermediate_size=4 * s["d"],
            moe_intermediate_size=s["hidden"],
            n_routed_experts=s["experts"],
            n_shared_experts=1,
            n_group=n_group,
            topk_group=topk_group,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            num_mtp_layers=0,
        )
        return transformers.DeepseekV3ForCausalLM(config)
    if family == "gpt-oss":
        g = s["gpt_oss"]
        factor, original = g["yarn"]
        common["attn_implementation"] = "eager"  # transformers' GptOss has no SDPA path (sinks)
        config = transformers.GptOssConfig(
            **common,
            head_dim=s["d"] // s["heads"],
            intermediate_size=s["hidden"],
            num_local_experts=s["experts"],
            sliding_window=g["window"],
            layer_types=gpt_oss_layer_types(s["layers"]),
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=g["rope_theta"],
                factor=factor,
                original_max_position_embeddings=original,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
            tie_word_embeddings=False,
        )
        return transformers.GptOssForCausalLM(config)
    if family == "qwen2-moe":
        config = transformers.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=s["hidden"],
            num_experts=s["experts"],
            shared_expert_intermediate_size=s.get("shared_hidden", 0),
            norm_topk_prob=True,
            qkv_bias=False,
        )
        return transformers.Qwen2MoeForCausalLM(config)
    if "shared_hidden" in s:
        raise SystemExit("Mixtral has no shared expert: use hf-qwen2-moe with --shape shared")
    config = transformers.MixtralConfig(
        **common, intermediate_size=s["hidden"], num_local_experts=s["experts"]
    )
    return transformers.MixtralForCausalLM(config)


def _hf_step_fn(family: str, grouped: bool, small_buckets: bool, shape: dict):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = _hf_model(family, grouped, shape)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=peer_ds_config(small_buckets)
    )

    def step(batch):
        out = engine(input_ids=batch["input_ids"], labels=batch["input_ids"])
        engine.backward(out.loss)
        engine.step()

    return step


def bench_job(
    rank: int, world: int, case: str, shape: str, warmup: int, steps: int, overrides: list[str]
) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    rss_before = _rss_now_mib()
    dims = SHAPES[shape]
    if case.startswith("moetrain"):
        step = _moetrain_step_fn(1 if case == "moetrain-ep1" else 2, overrides, dims)
    else:
        family = "qwen2-moe" if case.startswith("hf-qwen2-moe") else "mixtral"
        step = _hf_step_fn(family, case.endswith("grouped"), case.endswith("cpu-buckets"), dims)
    times, cpu_times = [], []
    for i, batch in enumerate(_batches(rank, world, warmup + steps, dims)):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step(batch)
        c1 = time.process_time()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(c1 - c0)
    return {
        "step_s": statistics.median(times),
        "cpu_step_s": statistics.median(cpu_times),  # this process's CPU time in the step
        "peak_rss_mib": _peak_rss_mib(),
        "rss_growth_mib": _peak_rss_mib() - rss_before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", nargs="*", default=CASES, choices=CASES + PEER_CASES)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument(
        "--world",
        type=int,
        choices=(1, 2),
        default=2,
        help="ranks; 1 times each case's step with no other rank to exchange with or wait for "
        "(its compute alone; not the moetrain case, whose EP=2 needs 2 ranks)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the moetrain cases (repeatable), e.g. model.loss_chunk_tokens=0",
    )
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.helpers
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.helpers.distributed import run_distributed

    world = args.world
    if world == 1 and "moetrain" in args.cases:
        ap.error("--world 1: the moetrain case runs EP=2, which needs 2 ranks (use moetrain-ep1)")
    tokens_per_step = world * MICRO * SHAPES[args.shape]["seq"]
    best: dict[str, dict] = {}
    peer_case = "hf-qwen2-moe" if "shared_hidden" in SHAPES[args.shape] else "hf-mixtral"
    ours = "moetrain" if "moetrain" in args.cases else "moetrain-ep1"
    paired: list[float] = []  # per round: moetrain (or moetrain-ep1) / peer tokens/s
    for rnd in range(args.rounds):
        this_round: dict[str, float] = {}
        for case in args.cases:
            ranks = run_distributed(
                bench_job,
                world,
                case,
                args.shape,
                args.warmup,
                args.steps,
                args.set,
                timeout=1800.0,
            )
            res = {
                "tokens_per_s": tokens_per_step / max(r["step_s"] for r in ranks),
                # per CPU second of the busiest rank: less sensitive to other processes' load
                "cpu_tokens_per_s": tokens_per_step / max(r["cpu_step_s"] for r in ranks),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
                "rss_growth_mib": max(r["rss_growth_mib"] for r in ranks),
            }
            print(f"round {rnd} {case}: {json.dumps(res)}", flush=True)
            this_round[case] = res["tokens_per_s"]
            if case not in best or res["tokens_per_s"] > best[case]["tokens_per_s"]:
                best[case] = res
        if ours in this_round and peer_case in this_round:
            paired.append(this_round[ours] / this_round[peer_case])
    peer = best.get(peer_case)
    print(
        f"\n| case | tokens/s ({world} ranks) | peak RSS / rank (MiB) | RSS growth / rank (MiB) |"
    )
    print("|---|---:|---:|---:|")
    for case, r in best.items():
        print(
            f"| {case} | {r['tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} | "
            f"{r['rss_growth_mib']:.0f} |"
        )
    if peer:
        for case in ("moetrain", "moetrain-ep1"):
            if case in best:
                r = best[case]
                print(
                    f"{case} vs {peer_case}: {r['tokens_per_s'] / peer['tokens_per_s']:.2f}x "
                    f"tokens/s, {r['peak_rss_mib'] / peer['peak_rss_mib']:.2f}x peak RSS, "
                    f"{r['rss_growth_mib'] / peer['rss_growth_mib']:.2f}x RSS growth"
                )
    if paired:
        rounds = ", ".join(f"{r:.2f}x" for r in paired)
        print(
            f"{ours} vs {peer_case} per round: {rounds} (median {statistics.median(paired):.2f}x)"
        )
    if args.json:
        args.json.write_text(json.dumps(best, indent=2) + "\n")


if __name__ == "__main__":
    main()
