"""The tiny moetrain models that each Hugging Face format represents exactly (``CASES``): the
model and moe settings of each format's case, on top of ``tests.helpers.convert_models.tiny_cfg``'s
3-layer model."""

from __future__ import annotations

from tests.helpers.case_shapes import LLAMA4_MODEL, MLA_SHAPE, QWEN_HYBRID_MODEL, QWEN_SHARED
from tests.helpers.hf_flags import DSA, GLM_INDEXER_TYPES, PHIMOE_ROPE
from tests.helpers.routed import OUTPUT_BIAS_FAMILY_STD

# moetrain settings that each format represents exactly (and that auto picks).
CASES = {
    "mixtral": dict(model={}, moe={}),
    "qwen2_moe": dict(
        model=dict(qkv_bias=True),
        moe=dict(
            first_k_dense=1,
            moe_every=2,
            num_shared_experts=1,
            shared_expert_gate=True,
            shared_expert_hidden=40,
            renormalize=False,
        ),
    ),
    "qwen3_moe": dict(model=dict(qk_norm=True), moe=dict(first_k_dense=1)),
    "glm4_moe": dict(
        model=dict(qk_norm=True, qkv_bias=True, partial_rotary_factor=0.5),
        moe=dict(
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "dots1": dict(  # dots.llm1's flags, a window and expert groups binding
        model=dict(
            qk_norm=True,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
        moe=dict(
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=2,
            route_scale=2.5,
            n_group=2,
            topk_group=1,
            bias_update_rate=1e-3,
        ),
    ),
    "olmoe": dict(
        model=dict(qk_norm=True, qk_norm_scope="projection", head_dim=None),
        moe=dict(renormalize=False),
    ),
    "minimax_m2": dict(  # MiniMax-M2's flags
        model=dict(qk_norm=True, qk_norm_scope="projection", partial_rotary_factor=0.5),
        moe=dict(score_func="sigmoid", bias_update_rate=1e-3),
    ),
    "afmoe": dict(  # Trinity's flags, a window binding (hf_models.py: layer 2 global, NoPE)
        model=dict(
            qk_norm=True,
            attention_output_gate=True,
            block_norms="sandwich",
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            nope_layers=[2],
            embedding_multiplier=32**0.5,
        ),
        moe=dict(
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "lfm2_moe": dict(  # LFM2-8B-A1B's flags and pattern (hf_models.py)
        model=dict(
            qk_norm=True,
            tie_embeddings=True,
            head_dim=None,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_attention="gated_conv",
        ),
        moe=dict(
            score_func="sigmoid",
            renormalize_eps=1e-6,
            first_k_dense=1,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "hunyuan_v1_moe": dict(  # Hunyuan-A13B's flags (NTK-alpha: folded into rope_theta)
        model=dict(qk_norm=True, qk_norm_position="after_rope", tie_embeddings=True),
        moe=dict(num_shared_experts=1),
    ),
    "deepseek_v3": dict(
        model=dict(
            **MLA_SHAPE,
            q_lora_rank=12,
            rope_interleave=True,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_max_seq_len=16,
            rope_mscale=1.0,
            rope_mscale_all_dim=0.8,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "kimi_linear": dict(  # Kimi Linear's (hf_flags.KIMI_LINEAR_ATTENTION)
        model=dict(
            **MLA_SHAPE,
            q_lora_rank=12,
            layer_types=["linear_attention"] * 2 + ["full_attention"],
            linear_attention="kda",
            linear_num_heads=2,
            linear_head_dim=8,
            linear_conv_kernel_dim=3,
            nope_layers=[2],
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "bailing_hybrid": dict(  # Ling 3.0's (hf_flags.LING_HYBRID)
        model=dict(
            **MLA_SHAPE,
            q_lora_rank=12,
            layer_types=["linear_attention"] * 2 + ["full_attention"],
            linear_attention="kda",
            linear_num_heads=4,
            linear_head_dim=8,
            linear_conv_kernel_dim=3,
            kda_full_rank_gates=True,
            kda_gate_lower_bound=-5.0,
            mla_head_gate=True,
            rope_interleave=True,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "deepseek_v32": dict(  # DeepSeek-V3.2's flags (hf_flags.DSA)
        model=dict(
            **MLA_SHAPE,
            **DSA,
            q_lora_rank=12,
            rope_interleave=True,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_max_seq_len=16,
            rope_mscale=1.0,
            rope_mscale_all_dim=0.8,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "glm_moe_dsa": dict(  # GLM-5's flags, one shared-indexer layer
        model=dict(
            **MLA_SHAPE,
            **DSA,
            q_lora_rank=12,
            rope_interleave=True,
            index_rope_interleave=True,
            indexer_types=GLM_INDEXER_TYPES,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "deepseek_v2": dict(
        model=dict(**MLA_SHAPE, rope_interleave=True),
        moe=dict(
            num_experts=8,
            first_k_dense=1,
            num_shared_experts=2,
            n_group=4,
            topk_group=2,
            group_score="max",
            renormalize=False,
            route_scale=1.5,
        ),
    ),
    "ernie4_5_moe": dict(  # ERNIE-4.5-21B-A3B's flags
        model=dict(rope_interleave=True, tie_embeddings=True),
        moe=dict(
            first_k_dense=1,
            num_shared_experts=2,
            bias_update_rate=1e-3,
            renormalize_min=1e-12,
        ),
    ),
    # The granite cases' weights drawn at std 0.05, not 0.02: the residual
    # branches x 0.22 and the logits / 6 shrink an expert's effect on the logits, so at 0.02 a
    # zeroed expert moved them 0.8 tolerances only (tests/unit/test_routed_experts.py)
    "granitemoe": dict(  # granite-3.0-1b-a400m's flags (tests/helpers/hf_models.py)
        model=dict(
            tie_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_scale=0.015625,
            logits_scaling=6.0,
            init_std=0.05,  # (drawn wider: the note above the granitemoe case)
        ),
        moe=dict(topk_before_score=True),
    ),
    "granitemoeshared": dict(  # the same, with one ungated shared expert
        model=dict(
            tie_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_scale=0.015625,
            logits_scaling=6.0,
            init_std=0.05,  # (drawn wider: the note above the granitemoe case)
        ),
        moe=dict(topk_before_score=True, num_shared_experts=1, shared_expert_hidden=40),
    ),
    "nemotron_h": dict(  # Nemotron 3's blocks and flags (tests/helpers/hf_flags.py), latent MoE
        model=dict(
            n_layers=5,
            rope_theta=10000.0,  # (no RoPE: the default, which its files do not store)
            init_std=0.1,  # (squared-ReLU experts of 0.02 weights barely move the logits)
            layer_types=["linear_attention", "none", "full_attention", "none", "none"],
            nope_layers=[2],
            ffn_activation="relu2",
            linear_attention="mamba2",
            mamba_num_heads=4,
            mamba_head_dim=8,
            mamba_n_groups=2,
            mamba_state_dim=8,
            mamba_chunk_size=8,
        ),
        moe=dict(
            layer_ffns=["none", "moe", "none", "moe", "dense"],
            score_func="sigmoid",
            activation="relu2",
            num_shared_experts=1,
            shared_expert_hidden=40,
            route_scale=2.5,
            n_group=2,
            topk_group=1,
            latent_dim=16,
        ),
    ),
    "granitemoehybrid": dict(  # Granite 4.0-H's (tests/helpers/hf_models.py), Mamba-2 chunks of 8
        model=dict(
            tie_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_scale=0.015625,
            logits_scaling=6.0,
            init_std=0.05,  # (drawn wider: the note above the granitemoe case)
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_attention="mamba2",
            mamba_num_heads=4,
            mamba_head_dim=16,
            mamba_n_groups=2,
            mamba_state_dim=8,
            mamba_chunk_size=8,
        ),
        moe=dict(topk_before_score=True, num_shared_experts=1, shared_expert_hidden=40),
    ),
    "gpt_oss": dict(  # gpt-oss-20b's flags (tests/helpers/hf_models.py), the window binding
        model=dict(
            qkv_bias=True,
            o_bias=True,
            attention_sinks=True,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling="yarn",
            rope_factor=32.0,
            rope_original_max_seq_len=4096,
            rope_beta_fast=32.0,
            rope_beta_slow=1.0,
            rope_truncate=False,
            init_std=OUTPUT_BIAS_FAMILY_STD,  # (every expert routed: routed.py)
        ),
        moe=dict(
            topk_before_score=True,
            router_bias=True,
            expert_biases=True,
            activation="clamped_swiglu",
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
        ),
    ),
    "phimoe": dict(  # Phi-3.5-MoE-instruct's flags (tests/helpers/hf_models.py)
        model=dict(
            norm="layernorm",
            qkv_bias=True,
            o_bias=True,
            lm_head_bias=True,
            max_seq_len=131072,
            rope_scaling="longrope",
            rope_original_max_seq_len=4096,
            rope_short_factor=PHIMOE_ROPE["short_factor"] * 2,
            rope_long_factor=PHIMOE_ROPE["long_factor"] * 2,
            rope_attention_factor=PHIMOE_ROPE["short_mscale"],
            rope_long_regime="short",
            init_std=OUTPUT_BIAS_FAMILY_STD,  # (every expert routed: routed.py)
        ),
        moe=dict(router_type="sparsemixer", renormalize=False),
    ),
    "qwen3_5_moe_text": dict(model=QWEN_HYBRID_MODEL, moe=dict(QWEN_SHARED, renormalize=True)),
    "qwen3_next": dict(  # (a dense first layer and no renormalisation: Qwen3.5 holds neither)
        model=QWEN_HYBRID_MODEL, moe=dict(QWEN_SHARED, first_k_dense=1, renormalize=False)
    ),
    "gemma4_text": dict(  # Gemma 4's pieces (hf_flags.GEMMA4_FLAGS), the window binding
        model=dict(
            qk_norm=True,
            value_norm=True,
            attention_scale=1.0,
            block_norms="sandwich",
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            global_head_dim=32,
            global_n_kv_heads=1,
            global_k_eq_v=True,
            global_rope_theta=100000.0,
            global_rope_proportion=0.25,
            ffn_activation="geglu",
            layer_scalar=True,
            embedding_multiplier=32**0.5,
            final_logit_softcap=3.0,
            tie_embeddings=True,
        ),
        moe=dict(
            activation="geglu",
            router_input_norm=True,
            expert_scale=True,
            dense_branch=True,
        ),
    ),
    "mimo_v2_flash": dict(  # MiMo-V2-Flash's flags (hf_flags.MIMO_V2_FLASH_FLAGS)
        model=dict(
            head_dim=12,
            v_head_dim=8,
            n_kv_heads=1,
            sliding_n_kv_heads=2,
            attention_sinks=True,
            attention_sinks_layers="sliding",
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            sliding_rope_theta=500.0,
            partial_rotary_factor=0.334,
            attention_value_scale=0.707,
        ),
        moe=dict(score_func="sigmoid", first_k_dense=1, route_scale=2.5, bias_update_rate=1e-3),
    ),
    "longcat_flash": dict(  # LongCat-Flash's flags (hf_flags.LONGCAT_FLASH_FLAGS)
        model=dict(
            **MLA_SHAPE,
            n_layers=4,
            dense_hidden=40,
            q_lora_rank=12,
            rope_interleave=True,
            mla_lora_scale=True,
        ),
        moe=dict(
            num_experts=4,
            zero_experts=2,
            top_k=3,
            renormalize=False,
            route_scale=6.0,
            shortcut=True,
            layer_ffns=["moe", "dense"] * 2,
            bias_update_rate=1e-3,
        ),
    ),
    "deepseek_v4": dict(  # DeepSeek-V4's flags (hf_flags.DEEPSEEK_V4_FLAGS)
        model=dict(
            attention="compressed",
            n_kv_heads=1,
            partial_rotary_factor=0.5,
            q_lora_rank=12,
            o_groups=2,
            o_lora_rank=6,
            sliding_window=3,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            compress_rate_csa=2,
            compress_rate_hca=4,
            compress_index_heads=2,
            compress_index_head_dim=8,
            compress_index_topk=2,
            compress_rope_theta=7000.0,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_max_seq_len=16,
            hc_streams=2,
            hc_sinkhorn_iters=7,
            ffn_activation="clamped_swiglu",
        ),
        moe=dict(
            score_func="sqrtsoftplus",
            hash_layers=[0],
            route_scale=1.5,
            num_shared_experts=1,
            activation="clamped_swiglu",
            swiglu_alpha=1.0,
            swiglu_limit=0.8,
            swiglu_up_offset=0.0,
            bias_update_rate=1e-3,
        ),
    ),
    "llama4_text": dict(  # Llama 4's pieces, each binding in 19 tokens (hf_flags.LLAMA4_FLAGS)
        model=LLAMA4_MODEL,
        moe=dict(
            score_func="sigmoid",
            topk_before_score=True,
            renormalize=False,
            score_on_input=True,
            num_shared_experts=1,
            moe_every=2,
        ),
    ),
}


# moetrain settings of the muP-style scalars, at a non-default value (only Granite has them)
MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_scale": 0.015625,
    "logits_scaling": 6.0,
}
