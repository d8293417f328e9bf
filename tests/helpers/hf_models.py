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
from tests.helpers.hf_flags import (
    DEEPSEEK_V4_FLAGS,
    DEEPSEEK_YARN,
    DSA,
    GEMMA4_FLAGS,
    GLM_INDEXER_TYPES,
    GPT_OSS_FLAGS,
    GRANITE_FLAGS,
    GRANITE_HYBRID,
    KIMI_LINEAR_ATTENTION,
    LING_HYBRID,
    LLAMA4_FLAGS,
    LONGCAT_FLASH_FLAGS,
    MIMO_V2_FLASH_FLAGS,
    NEMOTRON_H,
    PHIMOE_FLAGS,
    QWEN3_5_ROPE,
    QWEN_HYBRID,
)
from tests.helpers.random_constants import randomise_constants
from tests.helpers.routed import OUTPUT_BIAS_FAMILY_STD, spread_routers

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
OUTPUT_BIAS_INIT = {"initializer_range": OUTPUT_BIAS_FAMILY_STD}  # (every expert routed)


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
        "lfm2_moe": lambda: transformers.Lfm2MoeConfig(  # LFM2-8B-A1B's flags and pattern
            **{
                k: v
                for k, v in moe.items()
                if k not in ("head_dim", "rms_norm_eps", "num_key_value_heads")
            },
            num_key_value_heads=2,
            norm_eps=1e-6,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=4,
            num_dense_layers=1,
            routed_scaling_factor=2.5,
            layer_types=["conv", "full_attention", "conv"],
            tie_embedding=True,
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
        "bailing_hybrid": lambda: transformers.BailingHybridConfig(  # Ling 3.0's flags
            **_deepseek(moe, yarn=False),
            **LING_HYBRID,
            num_local_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=12,
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
        # Granite 4.0-H's flags, its layers Mamba-2 (several chunks of 8) and attention
        "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
            **moe,
            intermediate_size=24,
            num_local_experts=4,
            shared_intermediate_size=40,
            **GRANITE_FLAGS,
            **GRANITE_HYBRID,
        ),
        # Nemotron 3's blocks, one sublayer each (Mamba-2, MoE, attention, MoE, MLP, Mamba-2)
        "nemotron_h": lambda: transformers.NemotronHConfig(
            **{k: v for k, v in SMALL.items() if k not in ("rms_norm_eps", "rope_parameters")},
            **NEMOTRON_H,
        ),
        "gpt_oss": lambda: transformers.GptOssConfig(  # gpt-oss-20b's flags
            **{**moe, **GPT_OSS_FLAGS, **OUTPUT_BIAS_INIT},
            intermediate_size=24,
            num_local_experts=4,
        ),
        "phimoe": lambda: transformers.PhimoeConfig(  # Phi-3.5-MoE-instruct's flags
            **{**moe, **PHIMOE_FLAGS, **OUTPUT_BIAS_INIT}, intermediate_size=24, num_local_experts=4
        ),
        "gemma4_text": lambda: transformers.Gemma4TextConfig(  # Gemma 4's flags (hf_flags)
            **{**{k: v for k, v in SMALL.items() if k != "rope_parameters"}, **GEMMA4_FLAGS},
            intermediate_size=40,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=24,
        ),
        "mimo_v2_flash": lambda: transformers.MiMoV2FlashConfig(  # MiMo-V2-Flash's flags
            **{**moe, **MIMO_V2_FLASH_FLAGS},
            intermediate_size=40,
            moe_intermediate_size=24,
            n_routed_experts=4,
            routed_scaling_factor=2.5,
        ),
        # LongCat-Flash's flags: two sublayers per layer, shortcut MoE, zero experts, x6
        "longcat_flash": lambda: transformers.LongcatFlashConfig(
            **{
                **{k: v for k, v in SMALL.items() if k != "num_hidden_layers"},
                **LONGCAT_FLASH_FLAGS,
            }
        ),
        "deepseek_v4": lambda: transformers.DeepseekV4Config(  # DeepSeek-V4's (hf_flags)
            **{**{k: v for k, v in moe.items() if k != "rope_parameters"}, **DEEPSEEK_V4_FLAGS}
        ),
        "llama4_text": lambda: transformers.Llama4TextConfig(  # Llama 4's flags (below)
            **{**moe, **LLAMA4_FLAGS},
            intermediate_size=24,
            intermediate_size_mlp=40,
            num_local_experts=4,
        ),
    }


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
    spread_routers(model, config.hidden_size, seed)  # every expert routed (routed.py)
    with torch.no_grad():
        pad, emb = getattr(config, "pad_token_id", None), model.get_input_embeddings().weight
        if isinstance(pad, int) and 0 <= pad < emb.shape[0] and not emb[pad].any():
            # transformers zeroes the padding row; the data's EOS can have its id, and a zero
            # hidden state makes sparse attention's indexer score every key 0 (any keys fit)
            gen = torch.Generator().manual_seed(seed)
            emb[pad] = torch.randn(emb.shape[1], generator=gen).mul_(emb.std())
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
