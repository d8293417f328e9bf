"""The layout-parity tests' shared settings: the global batch's shape, the gradients compared,
and the variants (dotted settings on top of the tiny model) each layout is run with
(:mod:`tests.distributed.parity_jobs` runs them)."""

from __future__ import annotations

from typing import Any

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
