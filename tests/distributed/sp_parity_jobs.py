"""Rank functions for the sequence-parallel layout-parity test (importable by spawned ranks).

Every layout sees the same global batch: ``GLOBAL_MICRO`` whole rows per micro-step, packed
documents (``doc_ids``) whose boundaries fall inside and across the ranks' slices. A
sequence-parallel group of ``sp`` ranks takes the rows of its data-parallel rank
``rank // sp`` (``mb = GLOBAL_MICRO / (world / sp)`` rows each); the Trainer keeps each rank's
slice of the positions (``parallel.sequence_parallel.shard_batch``).
"""

from __future__ import annotations

from typing import Any

import torch

from moetrain.config import Config
from tests.distributed.parity_jobs import parity_config, reference_optimizer
from tests.distributed.parity_variants import VARIANTS as PARITY_VARIANTS

GLOBAL_MICRO = 4
ACCUM = 2
STEPS = 5
SEQ = 16
VOCAB = 96
GRAD_NAMES = (
    "embed.weight",
    "layers.0.attn.wq.weight",
    "layers.0.attn.wk.weight",
    "layers.1.attn.wv.weight",
    "layers.1.attn.wo.weight",
    "layers.0.attn.wkv_a.weight",  # MLA
    "layers.1.attn.wkv_b.weight",
    "layers.0.ffn.router.gate.weight",
    "layers.0.ffn.experts.w13",
    "layers.1.ffn.experts.w2",
    "layers.1.ffn.shared_expert.w2.weight",
    "lm_head.weight",
    "layers.0.attn.in_proj_qkv.weight",  # Gated DeltaNet
    "layers.0.attn.conv1d.weight",
    "layers.0.attn.A_log",
    "layers.0.attn.f_b_proj.weight",  # Kimi Delta Attention
    "layers.0.attn.q_conv1d.weight",
    "layers.0.attn.dt_bias",
    "layers.0.attn.in_proj.weight",  # Mamba-2, the gated convolution
    "layers.0.attn.conv1d.bias",
    "layers.0.attn.D",
    "layers.0.attn.norm.weight",
    "layers.0.attn.conv.weight",
    "layers.0.attn.conv.bias",
    "layers.1.attn.wk.weight",  # Gemma 4's global layer (keys as values), its dense MLP
    "layers.1.attn.k_norm.weight",
    "layers.0.dense.w2.weight",
    "layers.0.attn.wq_a.weight",  # DeepSeek sparse attention: the query latent, the indexer
    "layers.0.attn.indexer.wq_b.weight",
    "layers.0.attn.indexer.wk.weight",
    "layers.0.attn.indexer.k_norm.bias",
    "layers.0.attn.indexer.weights_proj.weight",
    "layers.0.attn_hc.fn",  # DeepSeek-V4's hyper-connections (``dsv4``)
    "layers.1.attn_hc.fn",
    "layers.1.ffn_hc.base",
)
VARIANTS: dict[str, dict[str, Any]] = {
    # blocks recomputed in backward: the head all-to-alls run again there
    "ckpt": {"parallel.activation_checkpointing": True},
    "mla": {
        "model.attention": "mla",
        "model.n_kv_heads": 4,
        "model.kv_lora_rank": 16,
        "model.qk_nope_head_dim": 8,
        "model.qk_rope_head_dim": 8,
        "model.v_head_dim": 8,
    },
    "bf16": {"train.precision": "bf16"},
    # Llama 4's pieces: the NoPE layer's temperature at the whole rows' positions, chunks
    # across the slices and cut at the documents
    "llama4": PARITY_VARIANTS["llama4"],
    # gpt-oss's: sinks, a sliding window (6) whose reach crosses the slices, every bias
    "gptoss": PARITY_VARIANTS["gptoss"],
    # drops at capacity factor 1, counted over the EP group's whole rows
    "capacity": PARITY_VARIANTS["capacity"],
    # Qwen3-Next's: a Gated DeltaNet layer (its query/key-head groups exchanged with their value
    # heads and convolution channels; state and window restarting at the documents) and a
    # gated-attention layer
    "hybrid": PARITY_VARIANTS["hybrid"],
    "muon": PARITY_VARIANTS["muon"],
    # the recurrent and convolution mixers (test_sp_parity_mixers.py): Kimi Delta Attention's
    # heads with their per-channel decays; Mamba-2's heads with the groups they read (2 groups
    # split over the ranks, or 1 repeated to both), chunks of 4 across the slices; the gated
    # convolution's channels (its bias); each with its window and state restarting at the
    # documents that cross the slices
    "kda": PARITY_VARIANTS["kda"],
    "kda_ckpt": {**PARITY_VARIANTS["kda"], "parallel.activation_checkpointing": True},
    "mamba": PARITY_VARIANTS["mamba"],
    "mamba_one_group": {**PARITY_VARIANTS["mamba"], "model.mamba_n_groups": 1},
    "gated_conv": PARITY_VARIANTS["gated_conv"],
    # Gemma 4's global layer (its own head dim, one key/value head repeated to each rank, keys
    # as values, its own RoPE at the slices' global positions) beside a sliding layer whose
    # window crosses the slices, and its other pieces (parity_jobs.VARIANTS["gemma4"])
    "gemma4": PARITY_VARIANTS["gemma4"],
    # DeepSeek sparse attention (parity_jobs.VARIANTS["dsa"]: 4 of up to 16 keys per query,
    # the second layer sharing the first's selection): each rank's queries select from and
    # attend to the whole rows' keys, gathered; its dense warm-up (the indexers alone train,
    # the dense attention's heads exchanged); the sparse stage with its blocks recomputed
    "dsa": PARITY_VARIANTS["dsa"],
    "dsa_warmup": PARITY_VARIANTS["dsa_warmup"],
    "dsa_ckpt": {**PARITY_VARIANTS["dsa"], "parallel.activation_checkpointing": True},
    # MiMo-V2-Flash's attention: a sliding layer (window 6 across the slices) with sinks, twice
    # the key/value heads (split over the ranks) and its own theta, a full layer whose single
    # key/value head is repeated to each rank; value heads narrower than query/key heads, scaled
    "mimo": {
        "model.layer_types": ["sliding_attention", "full_attention"],
        "model.sliding_window": 6,
        "model.n_kv_heads": 1,
        "model.sliding_n_kv_heads": 2,
        "model.v_head_dim": 4,
        "model.partial_rotary_factor": 0.5,
        "model.attention_value_scale": 0.7,
        "model.attention_sinks": True,
        "model.attention_sinks_layers": "sliding",
        "model.sliding_rope_theta": 500.0,
    },
    # DeepSeek-V4's pieces (parity_jobs.VARIANTS["dsv4"]): two hyper-connection streams per
    # token (each rank's positions' streams; the head exchange carries the branch input their
    # collapse makes), the first layer hash-routed by each rank's own positions' token ids
    "dsv4": PARITY_VARIANTS["dsv4"],
    # LongCat-Flash's zero experts (their copies stay on the rank), alone and with a capacity
    # factor that drops routed copies (the zero experts' copies take no slot)
    "zero_experts": PARITY_VARIANTS["zero_experts"],
    "zero_capacity": PARITY_VARIANTS["zero_capacity"],
}
# the world-1 job's references (plain torch): the base model's and these variants'
REFERENCES = (None, "mla", "gptoss", "capacity", "hybrid", "muon")


def sp_config(world: int, sp: int, ep: int, stage: int, *variants: str | None) -> Config:
    """The parity model at ``sp`` x ``ep`` on ``world`` ranks, with the settings of every key
    of :data:`VARIANTS` in ``variants`` (None: none)."""
    extra = {"parallel.sp_size": sp, "train.micro_batch_size": GLOBAL_MICRO // (world // sp)}
    for variant in variants:
        extra.update(VARIANTS.get(variant or "", {}))
    return parity_config(world, ep, stage, **extra)


def doc_ids_for(rows: int, g: torch.Generator) -> torch.Tensor:
    """Packed documents: a new one starts at each position with probability 1/4 (never at a
    slice boundary of an even row, so documents cross it)."""
    starts = torch.rand(rows, SEQ, generator=g) < 0.25
    starts[:, 0] = True
    for cut in (SEQ // 4, SEQ // 2, 3 * SEQ // 4):
        starts[0::2, cut] = False
    return starts.long().cumsum(1) - 1


def global_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """The global micro-batches of optimizer step ``step`` (same for every layout)."""
    g = torch.Generator().manual_seed(2000 + step)
    out = []
    for _ in range(ACCUM):
        seq = torch.randint(0, VOCAB, (GLOBAL_MICRO, SEQ + 1), generator=g)
        out.append(
            {
                "input_ids": seq[:, :-1].contiguous(),
                "labels": seq[:, 1:].contiguous(),
                "doc_ids": doc_ids_for(GLOBAL_MICRO, g),
            }
        )
    return out


def data_slice(batch: dict[str, torch.Tensor], rank: int, world: int, sp: int):
    """The whole rows of ``rank``'s data-parallel rank ``rank // sp``."""
    mb = GLOBAL_MICRO // (world // sp)
    d = rank // sp
    return {k: v[d * mb : (d + 1) * mb] for k, v in batch.items()}


def _biases(model: torch.nn.Module) -> list[list[float]]:
    return [b.tolist() for n, b in model.named_buffers() if n.endswith("router.expert_bias")]


def reference_run(variant: str | None = None) -> dict[str, Any]:
    """One process, plain torch (no DeepSpeed, no process group), the whole global batch."""
    from moetrain.model.moe.dispatch import LocalDispatcher
    from moetrain.model.transformer import Transformer
    from moetrain.optim.schedule import LRSchedule

    cfg = sp_config(1, 1, 1, 0, variant)
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model, cfg.moe)
    for layer in model.moe_layers():
        layer.dispatcher = LocalDispatcher(cfg.moe.num_experts, 1)
    o = cfg.optim
    opt = reference_optimizer(model, cfg)
    sched = LRSchedule(opt, o, cfg.train.max_steps, 0)
    routers = [m.router for m in model.moe_layers()]
    params = dict(model.named_parameters())
    names = [n for n in GRAD_NAMES if n in params and params[n].requires_grad]
    losses, norms, grads, dropped, zero_copies = [], [], {}, 0, 0
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total, loads = 0.0, None
        for router in routers:
            router.begin_step()
        for batch in global_batches(step):
            out = model(batch["input_ids"], batch["doc_ids"], batch["labels"])
            (out.loss / ACCUM).backward()
            for router in routers:
                router.end_micro_batch()
            total += float(out.loss.detach()) / ACCUM
            dropped += sum(int(m.dropped) for m in out.moe)
            zero_copies += sum(int(m.zero_copies) for m in out.moe)
            step_loads = torch.stack([m.tokens_per_expert_E for m in out.moe])
            loads = step_loads if loads is None else loads + step_loads
        if step == 0:
            grads = {n: params[n].grad.clone() for n in names}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        sched.step()
        for router, load in zip(routers, loads, strict=True):
            router.update_bias(load)
        losses.append(total)
        norms.append(float(norm))
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "biases": _biases(model),
        "dropped": dropped,
        # the zero-expert shares of every step and MoE layer, summed (as the layouts report)
        "zero_share": zero_copies / (ACCUM * GLOBAL_MICRO * SEQ * cfg.moe.top_k),
    }


def _parallel_run(cfg: Config, rank: int, world: int) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_grad

    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    topo = init_distributed(cfg)
    trainer = Trainer(cfg, topo)
    grads: dict[str, torch.Tensor] = {}

    def capture(tr: Trainer) -> None:
        params = dict(tr.model.named_parameters())
        for name in (n for n in GRAD_NAMES if n in params and params[n].requires_grad):
            grads[name] = safe_get_full_grad(params[name]).detach().clone().float()

    sp = cfg.parallel.sp_size
    losses, norms, dropped, zero_share = [], [], 0.0, 0.0
    for step in range(STEPS):
        micro = [data_slice(b, rank, world, sp) for b in global_batches(step)]
        rec = trainer.train_step(micro, before_step=capture if step == 0 else None)
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
        dropped += sum(v["dropped"] for v in rec["moe_layers"].values())
        zero_share += sum(v["zero_expert_share"] for v in rec["moe_layers"].values())
    lo, hi = topo.local_experts(cfg.moe.num_experts)
    result = {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "biases": _biases(trainer.model),
        "experts": (lo, hi),
        "tokens_per_step": trainer.tokens_per_step,
        "sp_rank": topo.sp_rank,
        "data_rank": topo.data_rank,
        "exchange": trainer.model.head_exchange is not None,
        "dropped": dropped,
        "zero_share": zero_share,
    }
    del trainer
    return result


def layout_key(layout: tuple) -> str:
    """``(sp, ep, stage[, variant ...])`` -> ``sp2_ep1_zero0[_mla]``; the first variant names
    the reference, the others (``ckpt``) change the layout alone."""
    sp, ep, stage, *variant = layout
    return "_".join([f"sp{sp}", f"ep{ep}", f"zero{stage}", *variant])


def layouts_job(
    rank: int, world: int, layouts: list[tuple], references: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """Run every ``(sp, ep, stage[, variant])`` of ``layouts`` on this group; the world-1 job
    runs the references (plain torch, one process): :data:`REFERENCES`, or those of the
    variants ``references`` only."""
    out: dict[str, Any] = {}
    if world == 1 and references is not None:
        for variant in references:
            out[f"reference_{variant}"] = reference_run(variant)
    elif world == 1:
        for variant in REFERENCES:
            out[f"reference_{variant}" if variant else "reference"] = reference_run(variant)
    for layout in layouts:
        sp, ep, stage, *variant = layout
        cfg = sp_config(world, sp, ep, stage, *variant)
        out[layout_key(layout)] = _parallel_run(cfg, rank, world)
    return out
