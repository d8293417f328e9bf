"""Tiny Hugging Face models and tokenizers built offline, as a user's existing weights.

:func:`save_hf_model` writes a random model of one family with ``save_pretrained`` (safetensors,
the layout transformers writes); :func:`save_hf_tokenizer` trains a small byte-level BPE with the
``tokenizers`` library and writes ``tokenizer.json`` + ``tokenizer_config.json`` as a model
directory holds them. Every family shares :data:`SMALL`'s shape (vocab 320, d 32, 3 layers).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from moetrain.convert.families import DENSE, FORMATS
from tests.helpers.random_constants import randomise_constants

SMALL: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    bos_token_id=2,
    eos_token_id=3,
    pad_token_id=0,
)
EOS_TOKEN = "<|endoftext|>"
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


def _moe_configs(transformers: Any) -> dict[str, Any]:
    moe = dict(SMALL, num_experts_per_tok=2)
    hybrid = {**moe, **QWEN_HYBRID}
    return {
        "qwen3_next": lambda: transformers.Qwen3NextConfig(
            **hybrid,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=4,
            shared_expert_intermediate_size=36,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
        "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(
            **{**hybrid, "rope_parameters": dict(QWEN3_5_ROPE)},
            moe_intermediate_size=24,
            num_experts=4,
            shared_expert_intermediate_size=36,
        ),
        "mixtral": lambda: transformers.MixtralConfig(
            **moe, intermediate_size=24, num_local_experts=4, sliding_window=None
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **moe,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=4,
            shared_expert_intermediate_size=36,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **moe,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=4,
            decoder_sparse_step=2,
        ),
        "olmoe": lambda: transformers.OlmoeConfig(**moe, intermediate_size=24, num_experts=4),
        "glm4_moe": lambda: transformers.Glm4MoeConfig(  # GLM-4.5's flags
            **{
                **moe,
                "rope_parameters": {**SMALL["rope_parameters"], "partial_rotary_factor": 0.5},
            },
            attention_bias=True,
            intermediate_size=40,
            moe_intermediate_size=24,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            use_qk_norm=False,
            n_group=1,
            topk_group=1,
            num_mtp_layers=0,
        ),
        "dots1": lambda: transformers.Dots1Config(  # dots.llm1's flags, a window binding
            **moe,
            intermediate_size=40,
            moe_intermediate_size=24,
            n_routed_experts=4,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_group=2,
            topk_group=1,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
        "minimax_m2": lambda: transformers.MiniMaxM2Config(  # MiniMax-M2's flags
            **{
                **moe,
                "rope_parameters": {**SMALL["rope_parameters"], "partial_rotary_factor": 0.5},
            },
            intermediate_size=24,
            num_local_experts=4,
        ),
        "afmoe": lambda: transformers.AfmoeConfig(  # Trinity's flags, a window binding
            **moe,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=4,
            num_shared_experts=1,
            num_dense_layers=1,
            route_scale=2.5,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            mup_enabled=True,
        ),
        "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(  # Hunyuan-A13B's flags
            **{
                **{k: v for k, v in SMALL.items() if k != "rope_parameters"},
                "rope_parameters": {
                    "rope_type": "dynamic",
                    "alpha": 8.0,
                    "factor": 1.0,
                    "rope_theta": 500.0,
                },
            },
            intermediate_size=24,
            num_experts=4,
            moe_topk=[2, 2, 2],
            tie_word_embeddings=True,
        ),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **_deepseek(moe, yarn=True),
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=12,
            rope_interleave=True,
            num_mtp_layers=0,
        ),
        "deepseek_v32": lambda: transformers.DeepseekV32Config(  # DeepSeek-V3.2's flags
            **_deepseek(moe, yarn=True),
            **DSA,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=12,
            num_nextn_predict_layers=0,
        ),
        "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(  # GLM-5's, one shared layer
            **_deepseek(moe, yarn=False),
            **DSA,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            q_lora_rank=12,
            num_nextn_predict_layers=0,
            indexer_types=GLM_INDEXER_TYPES,
        ),
        "kimi_linear": lambda: transformers.KimiLinearConfig(  # Kimi Linear's pattern and MoE
            **{k: v for k, v in _deepseek(moe, yarn=False).items() if k != "rope_parameters"},
            num_local_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=12,
            linear_attn_config=KIMI_LINEAR_ATTENTION,
        ),
        "deepseek_v2": lambda: transformers.DeepseekV2Config(
            **_deepseek(moe, yarn=False),
            n_routed_experts=8,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            q_lora_rank=None,
        ),
        "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(  # ERNIE-4.5-21B-A3B's flags
            **{k: v for k, v in SMALL.items() if k != "rope_parameters"},
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            intermediate_size=40,
            moe_intermediate_size=24,
            moe_num_experts=4,
            moe_k=2,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
            moe_norm_min=1e-12,
            use_bias=False,
            tie_word_embeddings=True,
        ),
        "granitemoe": lambda: transformers.GraniteMoeConfig(  # granite-3.0-1b-a400m's flags
            **moe, intermediate_size=24, num_local_experts=4, **GRANITE_FLAGS
        ),
        # granite's flags with a shared expert (GraniteMoeShared adds only that to GraniteMoe)
        "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(
            **moe,
            intermediate_size=24,
            num_local_experts=4,
            shared_intermediate_size=40,
            **GRANITE_FLAGS,
        ),
        "gpt_oss": lambda: transformers.GptOssConfig(  # gpt-oss-20b's flags
            **{**moe, **GPT_OSS_FLAGS}, intermediate_size=24, num_local_experts=4
        ),
        "phimoe": lambda: transformers.PhimoeConfig(  # Phi-3.5-MoE-instruct's flags
            **{**moe, **PHIMOE_FLAGS}, intermediate_size=24, num_local_experts=4
        ),
        "llama4_text": lambda: transformers.Llama4TextConfig(  # Llama 4's flags (below)
            **{**moe, **LLAMA4_FLAGS},
            intermediate_size=24,
            intermediate_size_mlp=40,
            num_local_experts=4,
        ),
    }


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
# sparse; 8 indexer heads, so that no two keys tie at a score of 0 (every head's product
# negative) where the top 4 end
DSA: dict[str, Any] = {"index_topk": 4, "index_n_heads": 8, "index_head_dim": 16}
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


def _deepseek(moe: dict[str, Any], yarn: bool) -> dict[str, Any]:
    """The tiny shape in DeepSeek's latent attention (every head its own keys and values)."""
    fields = {k: v for k, v in moe.items() if k != "head_dim"}
    fields.update(num_key_value_heads=moe["num_attention_heads"], first_k_dense_replace=1)
    fields.update(intermediate_size=40, moe_intermediate_size=24, kv_lora_rank=16)
    fields.update(qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
    if yarn:
        fields["rope_parameters"] = dict(DEEPSEEK_YARN)  # (transformers may edit it in place)
    return fields


def _dense_configs(transformers: Any) -> dict[str, Any]:
    return {
        "llama": lambda: transformers.LlamaConfig(**SMALL, intermediate_size=48),
        "mistral": lambda: transformers.MistralConfig(
            **SMALL, intermediate_size=48, sliding_window=None
        ),
        "qwen2": lambda: transformers.Qwen2Config(**SMALL, intermediate_size=48),
        "qwen3": lambda: transformers.Qwen3Config(**SMALL, intermediate_size=48),
        "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
            **{**SMALL, **QWEN_HYBRID, "rope_parameters": dict(QWEN3_5_ROPE)},
            intermediate_size=48,
        ),
        "olmo_hybrid": lambda: transformers.OlmoHybridConfig(  # Olmo-Hybrid's flags
            **{k: v for k, v in SMALL.items() if k not in ("head_dim", "rope_parameters")},
            rope_parameters={"rope_type": "default", "rope_theta": None},  # NoPE, as released
            intermediate_size=48,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_allow_neg_eigval=True,
        ),
    }


MOE_FAMILIES = FORMATS  # every registered family has a tiny model (tests/unit/test_families.py)
DENSE_FAMILIES = DENSE


def tiny_configs() -> dict[str, Any]:
    """Family -> a function making its tiny model's transformers config object."""
    import transformers

    return {**_moe_configs(transformers), **_dense_configs(transformers)}


def hf_config(family: str) -> Any:
    """The transformers config object of ``family``'s tiny model."""
    return tiny_configs()[family]()


def save_hf_model(
    family: str,
    out: Path,
    seed: int = 1,
    tokenizer: Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """A random ``family`` model saved at ``out`` (no tensor left constant: norms, biases,
    selection biases, so a swapped or dropped tensor shows); ``tokenizer``: a directory whose files
    are copied in; ``overrides``: config attributes changed from the family's tiny config.
    Returns ``out``."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomise_constants(model, seed)  # no tensor left constant (random_constants.py)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # Gated DeltaNet's decay, per step at a = 0 from
                decays = torch.linspace(-3.0, 1.5, p.numel())  # ~0.006 (weak) to ~7.6 (strong)
                p.copy_(decays.view(p.shape))  # (Kimi Linear's is (1, 1, H, 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.linspace(-2.0, 1.5, p.numel()))
    model.save_pretrained(out)
    if tokenizer is not None:
        for f in Path(tokenizer).iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def save_hf_tokenizer(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE (lossless on any text) on ``texts``; write ``tokenizer.json`` and
    ``tokenizer_config.json`` (EOS ``<|endoftext|>``, nothing added around the text) into
    ``out``. Returns ``out``."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 64,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
