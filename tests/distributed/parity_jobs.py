"""Rank functions for the layout-parity tests (importable by spawned processes).

One spawned job runs several configurations in one process group to save start-up time.
Every layout sees the same global batch: global micro-batch ``G`` sequences per micro-step,
``G / world`` on each rank (rank r takes rows ``[r*mb, (r+1)*mb)``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from moetrain.config import Config
from tests.helpers.configs import tiny_config

GLOBAL_MICRO = 4  # sequences per micro-step over all ranks
ACCUM = 2
STEPS = 10
SEQ = 16
GRAD_NAMES = (
    "embed.weight",
    "layers.0.attn.wq.weight",
    "layers.1.attn.wq.weight",  # (a NoPE layer with its query temperature in ``llama4``)
    "layers.1.attn.wo.weight",
    "layers.0.ffn.router.gate.weight",
    "layers.1.ffn.router.gate.weight",
    "layers.0.ffn.experts.w13",
    "layers.0.ffn.experts.w2",
    "layers.1.ffn.experts.w13",
    "layers.0.ffn.shared_expert.w1.weight",
    "layers.1.ffn.shared_expert.w2.weight",
    "layers.1.ffn.shared_gate.weight",
    "layers.0.ffn.w1.weight",  # a dense first layer (moe.first_k_dense)
    "layers.0.ffn.w3.weight",  # (with Muon, a matrix ZeRO-1/2 cut at dp=2)
    "lm_head.weight",
    "layers.2.eh_proj.weight",  # the multi-token-prediction modules (model.mtp_depth)
    "layers.3.ffn.experts.w2",
    "layers.0.attn.sinks",  # gpt-oss's pieces
    "layers.1.attn.wo.bias",
    "layers.0.ffn.router.gate.bias",
    "layers.0.ffn.experts.w13_bias",
    "layers.1.ffn.experts.w2_bias",
    "layers.0.attn_norm.bias",  # Phi-3.5-MoE's
    "lm_head.bias",
    "layers.0.attn.in_proj_qkv.weight",  # Gated DeltaNet's (``hybrid``)
    "layers.0.attn.conv1d.weight",
    "layers.0.attn.A_log",
    "layers.0.attn.dt_bias",
    "layers.0.attn.norm.weight",
    "layers.0.attn.f_b_proj.weight",  # Kimi Delta Attention's (``kda``)
    "layers.0.attn.q_conv1d.weight",
    "layers.0.attn.o_norm.weight",
    "layers.0.attn.wq_a.weight",  # latent attention with sparse attention's indexer
    "layers.1.attn.wkv_b.weight",
    "layers.0.attn.indexer.wq_b.weight",
    "layers.0.attn.indexer.k_norm.bias",
    "layers.1.attn.indexer.weights_proj.weight",
    # DeepSeek-V4's hyper-connections (``dsv4``): the attention branches' projections (the FFN
    # branches' and the final collapse's gradients cancel over the tokens, to about 3e-6 of
    # their scale in fp32 against fp64 in one process: no resolution at 1e-6)
    "layers.0.attn_hc.fn",
    "layers.1.attn_hc.fn",
    "layers.1.attn.wk.weight",  # Gemma 4's global layer (keys as values), its pieces
    "layers.1.attn.k_norm.weight",
    "layers.0.dense.w2.weight",
    "layers.1.ffn.router.expert_scale",
)
# DeepSeek sparse attention on latent attention: 4 of up to 16 keys per query
DSA = {
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.q_lora_rank": 16,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 8,
    "model.rope_interleave": True,
    "model.index_topk": 4,
    "model.index_n_heads": 4,
    "model.index_head_dim": 8,
    "model.index_recall_queries": 4,
}
# Routing variants, each combining several settings on top of the base configuration (softmax
# top-k, gated shared expert, aux-loss-free bias, global micro-batch balance statistics).
VARIANTS: dict[str, dict[str, Any]] = {
    "routing": {  # sigmoid scores with the bias, group-limited, a dense first layer
        "moe.num_experts": 8,
        "moe.score_func": "sigmoid",
        "moe.n_group": 4,
        "moe.topk_group": 2,
        "moe.first_k_dense": 1,
        "moe.aux_loss_scope": "sequence",
    },
    "capacity": {  # drops at capacity factor 1, top-k before softmax, step-wide statistics
        "moe.capacity_factor": 1.0,
        "moe.topk_before_score": True,
        "moe.aux_loss_scope": "global_batch",
    },
    "mtp": {  # two multi-token-prediction modules (MoE blocks), the weight's second phase
        "model.mtp_depth": 2,
        "model.mtp_loss_weight_final": 0.1,
        "model.mtp_loss_weight_final_step": 3,
    },
    "gptoss": {  # gpt-oss's pieces: sinks, a sliding and a full layer, every bias, the clamp
        "model.qkv_bias": True,
        "model.o_bias": True,
        "model.attention_sinks": True,
        "model.sliding_window": 6,
        "model.layer_types": ["sliding_attention", "full_attention"],
        "moe.topk_before_score": True,
        "moe.router_bias": True,
        "moe.expert_biases": True,
        "moe.activation": "clamped_swiglu",
        "moe.swiglu_alpha": 1.702,
        "moe.swiglu_limit": 0.5,  # binds at this model's activations
    },
    "phimoe": {  # Phi-3.5-MoE's: LayerNorm, the LM-head bias, sparsemixer routing
        "model.norm": "layernorm",
        "model.lm_head_bias": True,
        "moe.router_type": "sparsemixer",
        "moe.renormalize": False,
        "moe.bias_update_rate": 0.0,  # (sparsemixer has no selection bias)
    },
    # Llama 4's: interleaved RoPE, a chunked RoPE layer with the post-RoPE norm and a NoPE
    # layer with its query temperature (both binding at SEQ), top-k on the logits with sigmoid
    # weights on the experts' inputs, an ungated shared expert (the selection bias kept: on
    # the logits here)
    "llama4": {
        "model.rope_interleave": True,
        "model.attention_chunk_size": 6,
        "model.layer_types": ["chunked_attention", "full_attention"],
        "model.nope_layers": [1],
        "model.qk_norm_after_rope": True,
        "model.attn_temperature_floor": 4,
        "model.attn_temperature_scale": 0.5,
        "moe.score_func": "sigmoid",
        "moe.topk_before_score": True,
        "moe.renormalize": False,
        "moe.score_on_input": True,
        "moe.shared_expert_gate": False,
    },
    # Qwen3-Next's: a Gated DeltaNet layer then a gated-attention layer, zero-centred norms
    "hybrid": {
        "model.layer_types": ["linear_attention", "full_attention"],
        "model.linear_num_key_heads": 2,
        "model.linear_num_value_heads": 4,
        "model.linear_key_head_dim": 8,
        "model.linear_value_head_dim": 8,
        "model.attention_output_gate": True,
        "model.zero_centered_norm": True,
    },
    # Kimi Linear's: a Kimi Delta Attention layer then an attention layer
    "kda": {
        "model.layer_types": ["linear_attention", "full_attention"],
        "model.linear_attention": "kda",
        "model.linear_num_heads": 2,
        "model.linear_head_dim": 8,
    },
    # Granite 4.0-H's: a Mamba-2 layer (two groups, chunks of 4: several per row) then an
    # attention layer
    "mamba": {
        "model.layer_types": ["linear_attention", "full_attention"],
        "model.linear_attention": "mamba2",
        "model.mamba_num_heads": 4,
        "model.mamba_head_dim": 8,
        "model.mamba_n_groups": 2,
        "model.mamba_state_dim": 8,
        "model.mamba_chunk_size": 4,
    },
    # LFM2-MoE's: a short gated convolution layer (with its bias) then an attention layer,
    # sigmoid routing renormalised with its epsilon
    "gated_conv": {
        "model.layer_types": ["linear_attention", "full_attention"],
        "model.linear_attention": "gated_conv",
        "model.gated_conv_bias": True,
        "moe.score_func": "sigmoid",
        "moe.renormalize_eps": 1e-6,
    },
    # Gemma 4's (gemma4_text): a sliding layer then a global layer with its own head dim (16,
    # the sliding ones 8), one key/value head whose keys are its values, its own proportional
    # RoPE; q/k and value norms, sandwich norms, GeGLU, a dense MLP beside the experts, the
    # router's scalars, tied embeddings, soft-capping. Not its logits scaled by 1 nor its layer
    # scalar: per-token and per-layer pieces that send nothing across ranks, whose trajectory
    # here amplifies rounding (one process with every sum over the rows reordered already
    # differs from itself by 3e-5 in the clipped norms with either, 1e-1 with both, by step 10;
    # as it is, its twin's largest logit drifts from step 3: docs/NUMERICS.md)
    "gemma4": {
        "model.layer_types": ["sliding_attention", "full_attention"],
        "model.sliding_window": 6,
        "model.qk_norm": True,
        "model.value_norm": True,
        "model.global_head_dim": 16,
        "model.global_n_kv_heads": 1,
        "model.global_k_eq_v": True,
        "model.global_rope_theta": 1e5,
        "model.global_rope_proportion": 0.25,
        "model.block_norms": "sandwich",
        "model.ffn_activation": "geglu",
        "model.tie_embeddings": True,
        "model.embedding_multiplier": 32**0.5,
        "model.final_logit_softcap": 3.0,
        "moe.activation": "geglu",
        "moe.dense_branch": True,
        "moe.router_input_norm": True,
        "moe.expert_scale": True,
        "moe.num_shared_experts": 0,
        "moe.shared_expert_gate": False,
    },
    # DeepSeek sparse attention's sparse stage: the second layer attends to the first's
    # selection (GLM-5's shared indexer), the indexer trains on its KL alongside
    "dsa": {**DSA, "model.indexer_types": ["full", "shared"]},
    # its dense warm-up: the indexers alone train (every other parameter frozen)
    "dsa_warmup": {**DSA, "model.index_stage": "dense_warmup"},
    # DeepSeek-V4's pieces: two hyper-connection streams (what crosses the all-to-alls is the
    # collapse; the streams stay on the rank), sqrt(softplus) scores, the first layer
    # hash-routed (its table the same on every rank), the clamped SwiGLU without the offset
    "dsv4": {
        "model.hc_streams": 2,
        "moe.score_func": "sqrtsoftplus",
        "moe.hash_layers": [0],
        "moe.activation": "clamped_swiglu",
        "moe.swiglu_alpha": 1.0,
        "moe.swiglu_limit": 0.5,
        "moe.swiglu_up_offset": 0.0,
    },
    # LongCat-Flash's zero experts: 2 identity choices beside the 4 routed experts (about a
    # third of the copies go to them); their copies never cross ranks nor take a capacity slot.
    # Top 2 renormalised: with LongCat's top 3 unrenormalised x2 the router gate's first-step
    # gradient (small, from large identity terms that cancel) rounds at dp=2 x ep=2 too
    # coarsely (standard error 2.5e-7) for the gradient-bias check to resolve 1e-6
    "zero_experts": {"moe.zero_experts": 2, "moe.top_k": 2},
    # with a capacity factor that drops routed copies (0.75 of T * K / E copies, the zero
    # experts' counted in T * K: theirs take no slot), decided per EP group as ``capacity``'s.
    # (Not with the step-wide balance statistics: with zero experts this trajectory then
    # amplifies rounding, its twin's largest logit 7e-6 off by step 2)
    "zero_capacity": {"moe.zero_experts": 2, "moe.top_k": 2, "moe.capacity_factor": 0.75},
    # Muon (tests/distributed/test_muon_parity.py), with a dense first layer so that ZeRO's
    # partition boundaries cut matrices (the two layers alike put them between the layers);
    # with QK-clip at a threshold the heads' largest logits cross within the 10 steps (from
    # about 0.05 at the start)
    "muon": {"optim.name": "muon", "moe.first_k_dense": 1},
    "muonclip": {"optim.name": "muon", "moe.first_k_dense": 1, "optim.muon.qk_clip": 0.06},
}
# the variants that decide capacity per EP group: one reference per group count (``_g<n>``)
GROUPED = ("capacity", "zero_capacity")
# the variants whose one reference the world-1 job computes (capacity has one per group count)
REFERENCES = (
    *("routing", "mtp", "gptoss", "phimoe", "llama4", "hybrid", "kda", "mamba", "gated_conv"),
    *("dsa", "dsa_warmup"),
    "dsv4",
    "zero_experts",
    "gemma4",
)


def parity_config(world: int, ep: int, stage: int, **extra: Any) -> Config:
    """The tiny model with the parity tests' shape and training settings, for ``world`` ranks
    at expert parallelism ``ep`` and ZeRO stage ``stage``; ``extra``: more dotted settings."""
    settings = {
        "seed": 7,
        "model.vocab_size": 96,
        "model.dense_hidden": 64,
        "model.max_seq_len": SEQ,
        "moe.expert_hidden": 32,
        # a gated shared expert: under EP it runs while the all-to-alls are in flight
        "moe.num_shared_experts": 1,
        "moe.shared_expert_hidden": 16,
        "moe.shared_expert_gate": True,
        "moe.aux_loss_coef": 0.01,
        "moe.z_loss_coef": 0.001,
        "moe.bias_update_rate": 0.001,
        "data.seq_len": SEQ,
        "parallel.ep_size": ep,
        "parallel.zero_stage": stage,
        "optim.lr": 0.01,
        "optim.warmup_steps": 2,
        "optim.grad_clip": 0.3,  # the global norm starts near 2: clipping is active
        "optim.weight_decay": 0.1,
        "optim.schedule": "cosine",
        "train.max_steps": STEPS,
        "train.micro_batch_size": GLOBAL_MICRO // world,
        "train.grad_accum_steps": ACCUM,
        "train.eval_every": 0,
        "run_dir": "/tmp/moetrain-parity-unused",
    }
    return tiny_config(settings, extra)


def global_batches(step: int, vocab: int = 96) -> list[dict[str, torch.Tensor]]:
    """The global micro-batches of optimizer step ``step`` (same for every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(ACCUM):
        seq = torch.randint(0, vocab, (GLOBAL_MICRO, SEQ + 1), generator=g)
        out.append({"input_ids": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()})
    return out


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    mb = GLOBAL_MICRO // world
    return {k: v[rank * mb : (rank + 1) * mb] for k, v in batch.items()}


def _biases(model: torch.nn.Module) -> list[list[float]]:
    return [
        buf.tolist() for name, buf in model.named_buffers() if name.endswith("router.expert_bias")
    ]


def reference_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The reference's optimizer: torch's per-op AdamW; with ``optim.name: muon``, moetrain's
    Muon on the whole parameters of one process (its update against a written-out float64
    reference: tests/unit/test_muon.py)."""
    from moetrain.optim.groups import decay_groups
    from moetrain.optim.registry import build_optimizer

    o = cfg.optim
    if o.name == "muon":
        return build_optimizer(model, o, torch.device("cpu"))
    return torch.optim.AdamW(
        decay_groups(model, o), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False
    )


class ReferenceQKClip:
    """The largest attention logits in the reference, tracked on the forwards of every step (the
    layouts log them too), overall (``max_logits``) and per layer (``layer_max_logits``); with
    QK-clip (``optim.muon.qk_clip``) their row multipliers go to the optimizer before its
    step."""

    def __init__(self, model: torch.nn.Module, cfg: Config) -> None:
        from moetrain.train.attention_logits import AttentionLogits

        self.threshold = cfg.optim.muon.qk_clip
        self.logits = AttentionLogits(model, world_size=1)
        self.clipped = 0
        self.max_logits: list[float] = []
        self.layer_max_logits: list[list[float]] = []

    def begin_step(self) -> None:
        self.logits.track(True)

    def before_update(self, opt: torch.optim.Optimizer) -> None:
        maxima = self.logits.reduce(torch.device("cpu"))
        self.logits.track(False)
        self.max_logits.append(float(maxima.max()))
        self.layer_max_logits.append(maxima.max(dim=1).values.tolist())
        if self.threshold > 0:
            opt.set_row_scales(self.logits.row_scales(maxima, self.threshold))
            self.clipped += int((maxima > self.threshold).sum())


def reference_run(
    variant: str | None = None, capacity_groups: int = 1, rows_reversed: bool = False
) -> dict[str, Any]:
    """One process, plain torch (no DeepSpeed), per-expert loop experts: the simplest reference.

    ``capacity_groups``: how many expert-parallel groups the layout splits each global
    micro-batch into (world / ep_size); each decides capacity over its own tokens.
    ``rows_reversed``: the rows of every micro-batch in reverse order -- the same function, with every sum over tokens taken in another order:
    the run differs from the plain one by rounding alone (the rounding floor of the parity
    tests).
    """
    from moetrain.model.moe.dispatch import LocalDispatcher
    from moetrain.model.transformer import Transformer
    from moetrain.optim.schedule import LRSchedule

    cfg = parity_config(1, 1, 0, **{"moe.grouped_mm": False, **VARIANTS.get(variant, {})})
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model, cfg.moe)
    for layer in model.moe_layers():
        layer.dispatcher = LocalDispatcher(cfg.moe.num_experts, capacity_groups)
    o = cfg.optim
    opt = reference_optimizer(model, cfg)
    clip = ReferenceQKClip(model, cfg)
    sched = LRSchedule(opt, o, STEPS, 0)
    routers = [m.router for m in model.moe_layers()]
    params = dict(model.named_parameters())
    names = [n for n in GRAD_NAMES if n in params and params[n].requires_grad]
    losses, norms, grads, dropped = [], [], {}, 0
    zero_copies = 0  # (routed to zero experts: moe.zero_experts)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        loads = None
        for router in routers:
            router.begin_step()
        clip.begin_step()
        for batch in global_batches(step):
            if rows_reversed:  # (each capacity group's rows stay one group)
                batch = {k: v.flip(0) for k, v in batch.items()}
            weight = cfg.model.mtp_weight(step + 1)
            out = model(batch["input_ids"], None, batch["labels"], mtp_weight=weight)
            (out.loss / ACCUM).backward()
            for router in routers:
                router.end_micro_batch()
            total += float(out.loss.detach()) / ACCUM
            step_loads = torch.stack([m.tokens_per_expert_E for m in out.moe])
            loads = step_loads if loads is None else loads + step_loads
            dropped += sum(int(m.dropped) for m in out.moe)
            zero_copies += sum(int(m.zero_copies) for m in out.moe)
        if step == 0:
            grads = {n: params[n].grad.clone() for n in names}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        clip.before_update(opt)
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
        "weights": {n: params[n].detach().clone() for n in names},
        "biases": _biases(model),
        "dropped": dropped,
        "clipped": clip.clipped,
        "max_logits": clip.max_logits,
        "layer_max_logits": clip.layer_max_logits,
        # the zero-expert shares of every step and MoE layer, summed (as the layouts report)
        "zero_share": zero_copies / (ACCUM * GLOBAL_MICRO * SEQ * cfg.moe.top_k),
    }


def _parallel_run(cfg: Config, rank: int, world: int, steps: int = STEPS) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_grad

    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    topo = init_distributed(cfg)
    trainer = Trainer(cfg, topo)
    grads: dict[str, torch.Tensor] = {}
    ds_norm: list[float] = []

    def capture(tr: Trainer) -> None:
        params = dict(tr.model.named_parameters())
        for name in (n for n in GRAD_NAMES if n in params and params[n].requires_grad):
            g = safe_get_full_grad(params[name])
            grads[name] = g.detach().clone().float()
        if cfg.parallel.zero_stage == 0:
            # the norm DeepSpeed's own stage-0 clipping would use (max_norm=inf: no clipping)
            from deepspeed.runtime.utils import clip_grad_norm_

            ds_norm.append(float(clip_grad_norm_(tr.model.parameters(), max_norm=float("inf"))))

    losses, norms, dropped, replicas, clipped = [], [], 0.0, 0.0, 0
    max_logits, layer_max_logits = [], []
    zero_share = 0.0  # (metrics.jsonl's moe/layer<i>/zero_expert_share, summed)
    for step in range(steps):
        micro = [rank_slice(b, rank, world) for b in global_batches(step)]
        hook = capture if step == 0 else None
        rec = trainer.train_step(micro, before_step=hook, track_logits=True)
        max_logits.append(rec["attn/max_logit"])
        layer_max_logits.append(
            [v for k, v in rec.items() if k.startswith("attn/layer") and k.endswith("/max_logit")]
        )
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
        dropped += sum(v["dropped"] for v in rec["moe_layers"].values())
        replicas += rec.get("comm/a2a_replicas", 0.0)
        zero_share += sum(v["zero_expert_share"] for v in rec["moe_layers"].values())
        clipped += rec.get("attn/clipped_heads", 0)
    lo, hi = topo.local_experts(cfg.moe.num_experts)
    params = dict(trainer.model.named_parameters())
    result = {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "weights": {n: params[n].detach().float().clone() for n in grads},
        "biases": _biases(trainer.model),
        "experts": (lo, hi),
        "ds_moe": bool(trainer.engine.has_moe_layers),
        "ds_stage": int(trainer.engine.zero_optimization_stage()),
        "deepspeed_stage0_norm": ds_norm[0] if ds_norm else None,
        "dropped": dropped,
        "replicas": replicas,
        "zero_share": zero_share,
        "clipped": clipped,
        "max_logits": max_logits,
        "layer_max_logits": layer_max_logits,
        "cut": cut_matrix_values(trainer),
    }
    del trainer
    if topo.watch is not None:  # (its heartbeat thread would beat on through the next layouts)
        topo.watch.stop()
    return result


def cut_matrix_values(trainer: Any) -> int:
    """How many values of Muon's matrices this rank's ZeRO partitions cut (the exchange's
    size; 0 for another optimizer)."""
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return sum(ex.size for _, ex in getattr(opt, "pieces", {}).values() if ex is not None)


def layout_key(layout: tuple) -> str:
    """``(ep, stage)`` -> ``ep2_zero1``; more items name a variant: ``"ckpt"`` (activation
    checkpointing), ``"overlap"`` (DeepSpeed's overlap_comm), ``"shadow"`` (up to 2 shadow
    experts per layer) or a key of :data:`VARIANTS`."""
    return "_".join([f"ep{layout[0]}", f"zero{layout[1]}", *layout[2:]])


def reference_key(world: int, layout: tuple) -> str:
    """The reference run a layout is compared with (see :func:`layouts_job`)."""
    variant = next((v for v in layout[2:] if v in VARIANTS), None)
    if variant is None:
        return "reference"
    if variant in GROUPED:
        return f"reference_{variant}_g{world // layout[0]}"
    return f"reference_{variant}"


def layouts_job(
    rank: int,
    world: int,
    layouts: list[tuple],
    references: tuple[str, ...] | None = None,
    twins: bool | Collection[str] = False,
) -> dict[str, Any]:
    """Run every ``(ep_size, zero_stage[, variant])`` in ``layouts`` on this group; the world-1
    job also runs the references (plain torch, one process): the base one, those of
    :data:`REFERENCES` and capacity's, and the rows-reversed twin (``twin_<key>``: the rounding
    floor) of each whose key is in ``twins`` (every one when ``twins`` is True); or those of
    the variants ``references`` only (their twins with ``twins``)."""
    out: dict[str, Any] = {}
    if world == 1 and references is not None:
        for variant in references:
            out[f"reference_{variant}"] = reference_run(variant)
            if twins:
                out[f"twin_reference_{variant}"] = reference_run(variant, rows_reversed=True)
    elif world == 1:
        runs = {"reference": (None, 1)}
        runs |= {f"reference_{variant}": (variant, 1) for variant in REFERENCES}
        runs |= {f"reference_capacity_g{g}": ("capacity", g) for g in (1, 2)}
        twin_keys = runs if twins is True else (twins or ())
        # (zero experts at capacity: only where a layout asks for it, with -m long)
        if twins is True or "reference_zero_capacity_g2" in twin_keys:
            runs["reference_zero_capacity_g2"] = ("zero_capacity", 2)
        for key, (variant, groups) in runs.items():
            out[key] = reference_run(variant, groups)
            if key in twin_keys:
                out[f"twin_{key}"] = reference_run(variant, groups, rows_reversed=True)
    for layout in layouts:
        ep, stage, *variant = layout
        extra = {}
        if "ckpt" in variant:  # both recompute options: block checkpointing, expert SwiGLU
            extra["parallel.activation_checkpointing"] = True
            extra["moe.recompute_act"] = True
        if "overlap" in variant:
            extra["parallel.overlap_comm"] = True
        if "shadow" in variant:
            extra["parallel.shadow_experts"] = 2
        for name in variant:
            extra.update(VARIANTS.get(name, {}))
        cfg = parity_config(world, ep, stage, **extra)
        out[layout_key(layout)] = _parallel_run(cfg, rank, world)
    return out
