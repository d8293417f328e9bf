"""The flags of each family's released config.json at the tiny models' sizes (the corpus the
tiny Hugging Face models of :mod:`tests.helpers.hf_models` and the conversion tests are built
from): what each release sets, shrunk; where a value is from memory of the file, it says so."""

from __future__ import annotations

from typing import Any

# ERNIE-4.5-21B-A3B-PT's config.json as released (legacy top-level rope_theta, no
# moe_layer_end_index, Paddle's moe_* keys transformers does not read, one declared MTP layer),
# at the tiny ERNIE model's sizes
ERNIE_RELEASED_CONFIG: dict[str, Any] = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 40,
    "max_position_embeddings": 64,
    "model_type": "ernie4_5_moe",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "rms_norm_eps": 1e-05,
    "use_cache": False,
    "vocab_size": 320,
    "rope_theta": 500000,
    "use_bias": False,
    "moe_num_experts": 4,
    "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1,
    "moe_intermediate_size": 24,
    "moe_capacity": [4, 4, 4],
    "moe_gate": "topk",
    "moe_k": 2,
    "moe_layer_interval": 1,
    "moe_use_aux_free": True,
    "dtype": "bfloat16",
    "num_nextn_predict_layers": 1,
    "multi_token_pred_lambda": 0.3,
    "tie_word_embeddings": True,
}

# The flags of granite-3.0-1b-a400m's config.json as released (from memory of that file, with
# transformers' GraniteMoeConfig defaults where it has no key; granite-3.1-3b-a800m's are the
# same but for its sizes): the muP scalars (embedding x 12, residual branches x 0.22, attention
# scale 1/64 = 1/head_dim at its head_dim 64, logits / 6), tied embeddings, attention dropout
# 0.1 (training only), legacy top-level rope_theta, bf16; sizes shrunk to the tiny models'
GRANITE_RELEASED_CONFIG: dict[str, Any] = {
    "architectures": ["GraniteMoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.1,
    "attention_multiplier": 0.015625,
    "bos_token_id": 0,
    "embedding_multiplier": 12.0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 24,
    "logits_scaling": 6.0,
    "max_position_embeddings": 64,
    "model_type": "granitemoe",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "output_router_logits": False,
    "pad_token_id": 0,
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 320,
}
# the flags above as GraniteMoeConfig arguments
GRANITE_FLAGS: dict[str, Any] = {
    k: GRANITE_RELEASED_CONFIG[k]
    for k in (
        "attention_dropout",
        "attention_multiplier",
        "embedding_multiplier",
        "logits_scaling",
        "residual_multiplier",
        "router_aux_loss_coef",
        "tie_word_embeddings",
    )
}

# microsoft/Phi-3.5-MoE-instruct's flags: its rope_scaling (longrope, both mscales
# 1.243163121016122, original 4096; the first head_dim / 2 of its factor lists) as public copies
# of its config.json spell it; attention_bias, lm_head_bias, max_position_embeddings =
# sliding_window = 131072, router_jitter_noise = input_jitter_noise = 0.01,
# router_aux_loss_coef 0.0 and rope_theta 10000 from memory of that file; sizes shrunk
PHIMOE_ROPE: dict[str, Any] = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.0399999618530273, 1.0399999618530273, 1.0399999618530273],
    "long_factor": [1.0199999809265137, 1.0299999713897705, 1.0399999618530273, 1.05],
    "short_mscale": 1.243163121016122,
    "long_mscale": 1.243163121016122,
    "original_max_position_embeddings": 4096,
}
PHIMOE_FLAGS: dict[str, Any] = {
    "rope_parameters": PHIMOE_ROPE,
    "max_position_embeddings": 131072,
    "sliding_window": 131072,
    "attention_bias": True,
    "lm_head_bias": True,
    "router_jitter_noise": 0.01,
    "input_jitter_noise": 0.01,
    "router_aux_loss_coef": 0.0,
    "tie_word_embeddings": False,
}


# gpt-oss-20b's config.json flags as released (from memory of that file: no hub access here),
# at the tiny sizes: alternating sliding / full layers (transformers' default layer_types),
# q/k/v/o biases, YaRN without truncation; the window is shorter than the tests' sequences
GPT_OSS_FLAGS: dict[str, Any] = {
    "attention_bias": True,
    "sliding_window": 6,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
}


# gpt-oss-20b's config.json as released (from memory: legacy rope_scaling and top-level
# rope_theta, its experts_per_token / initial_context_length keys, no swiglu_alpha (1.702 is
# transformers' default), MXFP4 quantization_config left out), at the tiny sizes
GPT_OSS_RELEASED_CONFIG: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 3,
    "experts_per_token": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 24,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "max_position_embeddings": 64,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "output_router_logits": False,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 6,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 320,
}


# Llama 4's flags at the tiny sizes, each where it binds in 19 tokens: MoE every second layer
# (Maverick's interleave_moe_layer_step), the last layer NoPE (as every fourth is in the
# releases) with its query temperature (floor_scale 8192 -> 4), the others chunked
# (attention_chunk_size 8192 -> 6) with the post-RoPE query/key norm (Scout's use_qk_norm)
LLAMA4_FLAGS: dict[str, Any] = {
    "no_rope_layers": [1, 1, 0],
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": 6,
    "use_qk_norm": True,
    "attn_temperature_tuning": True,
    "floor_scale": 4,
    "attn_scale": 0.5,
    "tie_word_embeddings": False,
}


# Gemma 4 26B-A4B's flags at the tiny sizes: two sliding layers (a window of 6) and a global
# one with twice the head dim, one key/value head as keys and values, proportional RoPE of its
# own theta; a soft cap that binds on the tiny logits
GEMMA4_FLAGS: dict[str, Any] = dict(
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=6,
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 100000.0,
        },
    },
    final_logit_softcapping=3.0,
    hidden_activation="gelu_pytorch_tanh",
    enable_moe_block=True,
    hidden_size_per_layer_input=0,
    tie_word_embeddings=True,
)


# Qwen3-Next's hybrid layers at the tiny sizes: layers 0, 1 Gated DeltaNet, layer 2 gated
# attention; a quarter of each head rotated (as released), 64 positions
QWEN_HYBRID: dict[str, Any] = dict(
    full_attention_interval=3,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
)
# Qwen3.5's multimodal RoPE keys as released (in the released proportions; plain RoPE on text)
QWEN3_5_ROPE: dict[str, Any] = dict(
    QWEN_HYBRID["rope_parameters"], mrope_section=[0, 0, 2], mrope_interleaved=True
)


# Granite 4.0-H's hybrid layers at the tiny sizes: layers 0 and 2 Mamba-2 (4 heads of 16 in two
# groups, state 8, chunks of 8), layer 1 attention, with RoPE
GRANITE_HYBRID: dict[str, Any] = dict(
    layer_types=["mamba", "attention", "mamba"],
    position_embedding_type="rope",
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
)


# YaRN as DeepSeek-V2 / V3 are released (both mscales), over 16 original positions
DEEPSEEK_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 5000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 24.0,
    "beta_slow": 2.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


# DeepSeek sparse attention at the tiny sizes: 4 keys per query, so the tests' sequences are
# sparse; 16 indexer heads, so that no two keys tie at a score of 0 (every head's product
# negative) where the top 4 end (with 8, about one query in 4,000 of the tests' text did)
DSA: dict[str, Any] = {"index_topk": 4, "index_n_heads": 16, "index_head_dim": 16}
# Kimi Linear's layers at the tiny sizes: two Kimi Delta Attention layers, then latent attention
KIMI_LINEAR_ATTENTION: dict[str, Any] = {
    "kda_layers": [1, 2],
    "full_attn_layers": [3],
    "num_heads": 2,
    "head_dim": 8,
    "short_conv_kernel_size": 3,
}
# GLM-MoE-DSA's per-layer indexers: the middle layer attends to the first layer's selection
GLM_INDEXER_TYPES = ["full", "shared", "full"]

# Nemotron 3's flags at the tiny sizes (NVIDIA-Nemotron-3-Nano-30B-A3B's config.json, from memory
# of that file: its pattern's block kinds, sigmoid routing with a selection bias,
# routed_scaling_factor 2.5, norm_topk_prob, squared-ReLU MLPs), with the latent MoE of the
# larger Nemotron 3 models: Mamba-2 (4 heads of 8 in two groups, state 8, chunks of 8), MoE,
# attention, MoE, dense MLP, Mamba-2; experts in groups of 2 computing in a latent of 16
NEMOTRON_H: dict[str, Any] = dict(
    hybrid_override_pattern="ME*E-M",
    mamba_num_heads=4,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=8,
    conv_kernel=4,
    chunk_size=8,
    use_conv_bias=True,
    mamba_hidden_act="silu",
    mlp_hidden_act="relu2",
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40,
    moe_latent_size=16,
    intermediate_size=48,
    routed_scaling_factor=2.5,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    # (released 0.02: weights that small leave the squared-ReLU experts' share of the logits
    # below the tests' tolerance)
    initializer_range=0.1,
)

# MiMo-V2-Flash's flags at the tiny shape: layer 0 full, the others sliding (a window binding)
# with twice the key/value heads and sinks, query/key heads of 12 beside value heads of 8, a
# RoPE theta per layer type rotating int(12 * 0.334) = 4 dims, the value scale, a dense first
# layer
MIMO_V2_FLASH_FLAGS = dict(
    head_dim=12,
    v_head_dim=8,
    num_key_value_heads=1,
    sliding_window=6,
    layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    rope_parameters={
        "full_attention": {
            "rope_type": "default",
            "rope_theta": 5000.0,
            "partial_rotary_factor": 0.334,
        },
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.334,
        },
    },
    attention_value_scale=0.707,
)

# LongCat-Flash's flags at the tiny shape: two decoder layers (four sublayers), latent
# attention with the query LoRA (its LoRA scales always on in transformers' class), 4 routed
# and 2 zero experts, top 3 unrenormalised, x6 (released: 512 + 256, top 12, x6)
LONGCAT_FLASH_FLAGS = dict(
    num_layers=2,
    num_key_value_heads=4,
    ffn_hidden_size=40,
    q_lora_rank=12,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=12,
    n_routed_experts=4,
    zero_expert_num=2,
    moe_topk=3,
    expert_ffn_hidden_size=24,
    routed_scaling_factor=6.0,
)

# Ling 3.0's flags at the tiny shape: layers 0, 1 Kimi Delta Attention (the attention's 4 heads
# of head_dim 8, convolutions of 3, the bounded gate at -5 as released), layer 2 latent
# attention with its head gate (layer_group_size 3 for the released 6); no MTP layer (the
# class builds none)
LING_HYBRID = dict(
    head_dim=8,
    layer_group_size=3,
    short_conv_kernel_size=3,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    num_mtp_layers=0,
)

# DeepSeek-V4's flags at the tiny shape: one layer of each attention type (sliding, compressed
# sparse, heavily compressed; window 3, compress rates 2 and 4, the indexer keeping 2 entries,
# so that 19 tokens see compression and the selection bind), one key/value head, a quarter of
# each head rotated in pairs with YaRN on the compressed layers, 2 hyper-connection streams, the
# first layer hash-routed, sqrt(softplus) x1.5, the clamped SwiGLU (released: 43 layers, window
# 128, rates 4 and 128, top 512 entries, 4 streams, 3 hash layers, limit 10)
DEEPSEEK_V4_FLAGS = dict(
    num_key_value_heads=1,
    head_dim=16,
    partial_rotary_factor=0.5,
    q_lora_rank=12,
    o_groups=2,
    o_lora_rank=6,
    sliding_window=3,
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    index_n_heads=2,
    index_head_dim=8,
    index_topk=2,
    compress_rope_theta=7000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    hc_mult=2,
    hc_sinkhorn_iters=7,
    mlp_layer_types=["hash_moe", "moe", "moe"],
    n_routed_experts=4,
    moe_intermediate_size=24,
    routed_scaling_factor=1.5,
    swiglu_limit=0.8,
    num_nextn_predict_layers=0,
)
