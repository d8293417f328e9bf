"""Released Hugging Face configs (flags as released, sizes shrunk) import as the moetrain model
they describe; the fields moetrain cannot compute are refused by name."""

from __future__ import annotations

import json

import pytest

from moetrain.config import ConfigError
from moetrain.config.model import FULL
from moetrain.convert.families import family
from moetrain.convert.formats import choose_format, config_from_hf, hf_config
from tests.helpers.hf_flags import PHIMOE_ROPE

transformers = pytest.importorskip("transformers")


def test_granite_released_config_imports() -> None:
    """granite-3.0-1b-a400m's config.json as released (legacy rope_theta, dropout, bf16):
    its routing, scalars and head."""
    from tests.helpers.hf_flags import GRANITE_RELEASED_CONFIG

    cfg = config_from_hf(GRANITE_RELEASED_CONFIG)
    m, moe = cfg.model, cfg.moe
    assert (m.embedding_multiplier, m.residual_multiplier) == (12.0, 0.22)
    assert (m.attention_scale, m.logits_scaling, m.tie_embeddings) == (0.015625, 6.0, True)
    assert (m.head_dim, m.rope_theta, m.norm_eps, m.qkv_bias) == (8, 10000.0, 1e-6, False)
    assert (moe.score_func, moe.topk_before_score, moe.num_shared_experts) == ("softmax", True, 0)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (4, 2, 24)
    assert moe.moe_layers(3) == [0, 1, 2]
    assert choose_format(cfg) == "granitemoe"


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"embedding_multiplier": 0.0}, "embedding_multiplier"),
        ({"logits_scaling": None}, "logits_scaling"),
        ({"attention_multiplier": -1.0}, "attention_multiplier"),
        ({"residual_multiplier": None}, "residual_multiplier"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
    ],
)
def test_granite_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    from tests.helpers.hf_flags import GRANITE_RELEASED_CONFIG

    d = {
        k: v
        for k, v in GRANITE_RELEASED_CONFIG.items()
        if "rope" not in k or "rope_parameters" not in changes
    }
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**d, **changes})


def _deepseek_dict(family_name: str, **changes) -> dict:
    from tests.helpers.hf_models import hf_config as tiny_hf_config

    d = tiny_hf_config(family_name).to_dict()
    d["architectures"] = [family(family_name).architecture]
    return {**d, **changes}


def test_deepseek_v3_config_imports_mla_yarn_and_routing() -> None:
    cfg = config_from_hf(_deepseek_dict("deepseek_v3"))
    m, moe = cfg.model, cfg.moe
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == ("mla", 12, 16, 12)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.rope_interleave) == (8, 8, True)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len) == ("yarn", 4.0, 16)
    assert (m.rope_beta_fast, m.rope_beta_slow, m.rope_mscale_all_dim) == (24.0, 2.0, 0.8)
    assert (moe.score_func, moe.n_group, moe.topk_group, moe.group_score) == (
        "sigmoid",
        4,
        2,
        "top2_sum",
    )
    assert (moe.route_scale, moe.num_shared_experts, moe.first_k_dense) == (2.5, 1, 1)
    v2 = config_from_hf(_deepseek_dict("deepseek_v2")).moe
    assert (v2.score_func, v2.renormalize, v2.group_score, v2.n_group) == (
        "softmax",
        False,
        "max",
        4,
    )
    greedy = config_from_hf(_deepseek_dict("deepseek_v2", topk_method="greedy")).moe
    assert (greedy.n_group, greedy.topk_group) == (1, 1)


@pytest.mark.parametrize(
    "family_name, changes, key",
    [
        (
            "deepseek_v3",
            {"quantization_config": {"quant_method": "gptq"}},
            "quantization_config.quant_method",
        ),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
        ("deepseek_v3", {"yarn_attention_factor": 2.0}, "rope_parameters.attention_factor"),
    ],
)
def test_deepseek_configs_moetrain_cannot_compute_are_refused(family_name, changes, key) -> None:
    d = _deepseek_dict(family_name)
    for name in ("attention_factor", "truncate"):
        if f"yarn_{name}" in changes:
            d["rope_parameters"] = {**d["rope_parameters"], name: changes.pop(f"yarn_{name}")}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**d, **changes})


def test_ernie_released_config_imports() -> None:
    """ERNIE-4.5-21B-A3B's config.json as released (legacy rope_theta, no end index, keys
    transformers does not read): its routing, placement, RoPE and head."""
    from tests.helpers.hf_flags import ERNIE_RELEASED_CONFIG

    cfg = config_from_hf(ERNIE_RELEASED_CONFIG)
    m, moe = cfg.model, cfg.moe
    assert (m.rope_theta, m.rope_interleave, m.tie_embeddings, m.qkv_bias) == (
        500000.0,
        True,
        True,
        False,
    )
    assert (m.head_dim, m.dense_hidden, m.norm_eps, m.rope_scaling) == (8, 40, 1e-5, "none")
    assert (moe.score_func, moe.renormalize, moe.renormalize_min) == ("softmax", True, 1e-12)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (4, 2, 24)
    assert (moe.num_shared_experts, moe.shared_hidden, moe.shared_expert_gate) == (2, 48, False)
    assert moe.moe_layers(3) == [1, 2]
    # start 1, every second layer: ERNIE counts (layer + 1) from 0 -> layers 1 and 3
    every2 = config_from_hf(
        {**ERNIE_RELEASED_CONFIG, "num_hidden_layers": 4, "moe_layer_interval": 2}
    )
    assert every2.moe.moe_layers(4) == [1, 3]


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"use_bias": True}, "use_bias"),
        ({"num_hidden_layers": 4, "moe_layer_end_index": 2}, "moe_layer_start_index"),
        ({"moe_norm_min": None}, "moe_norm_min"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
    ],
)
def test_ernie_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    from tests.helpers.hf_flags import ERNIE_RELEASED_CONFIG

    d = {
        k: v
        for k, v in ERNIE_RELEASED_CONFIG.items()
        if "rope" not in k or "rope_parameters" not in changes
    }
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**d, **changes})


def test_gpt_oss_released_config_imports() -> None:
    """gpt-oss-20b's config.json as released (legacy rope keys): every piece of its model."""
    from tests.helpers.hf_flags import GPT_OSS_RELEASED_CONFIG

    cfg = config_from_hf(GPT_OSS_RELEASED_CONFIG)
    m, moe = cfg.model, cfg.moe
    assert (m.qkv_bias, m.o_bias, m.attention_sinks, m.sliding_window) == (True, True, True, 6)
    assert [m.attention_window(i) for i in range(3)] == [6, None, 6]
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len) == ("yarn", 32.0, 4096)
    assert (m.rope_beta_fast, m.rope_beta_slow, m.rope_truncate, m.rope_theta) == (
        32.0,
        1.0,
        False,
        150000.0,
    )
    assert (moe.topk_before_score, moe.router_bias, moe.expert_biases) == (True, True, True)
    assert (moe.activation, moe.swiglu_alpha, moe.swiglu_limit) == ("clamped_swiglu", 1.702, 7.0)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (4, 2, 24)
    assert choose_format(cfg) == "gpt_oss"


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"attention_dropout": 0.1}, "attention_dropout"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "layer_types",
        ),
        ({"sliding_window": 64}, "model.sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ],
)
def test_gpt_oss_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    from tests.helpers.hf_flags import GPT_OSS_RELEASED_CONFIG

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**GPT_OSS_RELEASED_CONFIG, **changes})


def phimoe_released(**changes) -> dict:
    """Phi-3.5-MoE-instruct's config.json (its legacy rope_scaling and top-level rope_theta) at
    the tiny sizes, with ``changes``."""
    from tests.helpers.hf_flags import PHIMOE_FLAGS

    rope = {k: v for k, v in PHIMOE_ROPE.items() if k not in ("rope_type", "rope_theta")}
    d = {
        "architectures": ["PhimoeForCausalLM"],
        "model_type": "phimoe",
        **{k: v for k, v in PHIMOE_FLAGS.items() if k != "rope_parameters"},
        "rope_scaling": {**rope, "type": "longrope"},
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 4096,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
    }
    return {**d, **changes}


def test_phimoe_released_config_imports() -> None:
    """Phi-3.5-MoE-instruct's flags: LayerNorm, all attention biases, a head bias, sparsemixer
    at its eps, LongRoPE with its mscale as the attention factor, the short factors past the
    original 4096 positions too (sliding_window 131072 spans the whole context)."""
    cfg = config_from_hf(phimoe_released())
    m, moe = cfg.model, cfg.moe
    assert (m.norm, m.qkv_bias, m.o_bias, m.lm_head_bias) == ("layernorm", True, True, True)
    assert (m.rope_scaling, m.rope_original_max_seq_len, m.rope_long_regime) == (
        "longrope",
        4096,
        "short",
    )
    assert m.rope_attention_factor == 1.243163121016122 and len(m.rope_short_factor) == 4
    assert (moe.router_type, moe.router_jitter_eps, moe.renormalize) == ("sparsemixer", 0.01, False)
    assert choose_format(cfg) == "phimoe"
    hf = hf_config(cfg, "phimoe")
    assert (
        hf.rope_parameters["short_mscale"] == hf.rope_parameters["long_mscale"] == 1.243163121016122
    )
    assert (hf.attention_bias, hf.lm_head_bias, hf.router_jitter_noise) == (True, True, 0.01)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"num_experts_per_tok": 4}, "num_experts_per_tok"),
        ({"sliding_window": 2048}, "sliding_window"),
        (
            {"rope_scaling": {**phimoe_released()["rope_scaling"], "long_mscale": 1.5}},
            "rope_parameters.long_mscale",
        ),
        (
            {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 4096,
                    "short_mscale": 1.0,
                    "long_mscale": 1.0,
                }
            },
            "rope_parameters.rope_type",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_phimoe_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf(phimoe_released(**changes))


def _llama4_released(name: str = "Llama-4-Scout-17B-16E", **changes) -> dict:
    from pathlib import Path

    path = Path(__file__).parents[1] / "fixtures" / "released_configs" / "llama4_text"
    return {**json.loads((path / f"{name}.json").read_text()), **changes}


def test_llama4_released_configs_import() -> None:
    """Scout's and Maverick's config.json flags (tests/fixtures/released_configs/llama4_text):
    every piece of their models."""
    scout = config_from_hf(_llama4_released())
    m, moe = scout.model, scout.moe
    assert (m.rope_interleave, m.qk_norm_after_rope, m.nope_layers) == (True, True, [3])
    assert (m.attention_chunk_size, m.layer_types) == (32, ["chunked_attention"] * 3 + [FULL])
    assert (m.attn_temperature_floor, m.attn_temperature_scale) == (32, 0.1)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len) == ("llama3", 16.0, 16)
    assert (m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_theta) == (1.0, 1.0, 5e5)
    assert (m.head_dim, m.n_heads, m.n_kv_heads, m.dense_hidden) == (16, 5, 1, 64)
    assert (moe.score_func, moe.topk_before_score, moe.renormalize) == ("sigmoid", True, False)
    assert (moe.score_on_input, moe.num_shared_experts, moe.shared_hidden) == (True, 1, 32)
    assert (moe.num_experts, moe.top_k, moe.moe_layers(4)) == (4, 1, [0, 1, 2, 3])
    assert choose_format(scout) == "llama4_text"
    maverick = config_from_hf(_llama4_released("Llama-4-Maverick-17B-128E"))
    assert (maverick.model.qk_norm_after_rope, maverick.model.rope_scaling) == (False, "none")
    assert (maverick.moe.num_experts, maverick.moe.moe_layers(4)) == (8, [1, 3])
    assert (maverick.moe.first_k_dense, maverick.moe.moe_every) == (0, 2)
    # a chunk as long as the context is full attention; temperature tuning off, or no NoPE
    # layer, is none
    whole = config_from_hf(_llama4_released(attention_chunk_size=2048)).model
    assert (whole.attention_chunk_size, whole.layer_types) == (None, None)
    off = config_from_hf(_llama4_released(attn_temperature_tuning=False)).model
    assert (off.attn_temperature_floor, off.nope_layers) == (None, [3])
    all_rope = config_from_hf(_llama4_released(no_rope_layers=[1, 1, 1, 1])).model
    assert (all_rope.nope_layers, all_rope.attn_temperature_floor) == (None, None)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
        ({"no_rope_layers": [1, 0], "layer_types": ["full_attention"] * 4}, "no_rope_layers"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        (
            {"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None},
            "attention_chunk_size",
        ),
        ({"moe_layers": [0, 2, 3]}, "moe_layers/interleave_moe_layer_step"),
        ({"moe_layers": [1, 5]}, "moe_layers"),
        ({"floor_scale": 0}, "floor_scale"),
        ({"attn_scale": -0.1}, "attn_scale"),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_parameters.rope_type",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "quantization_config"),
    ],
)
def test_llama4_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf(_llama4_released(**changes))
