"""The pieces only some families have (another attention kind, muP-style scalars,
Phi-3.5-MoE's, gpt-oss's and Llama 4's pieces): every family without them names the setting."""

from __future__ import annotations

import pytest

from moetrain.config import ConfigError
from moetrain.convert.families import FORMATS, family
from moetrain.convert.formats import choose_format
from tests.helpers.case_shapes import MLA_SHAPE
from tests.helpers.configs import tiny_config
from tests.helpers.convert_cases import MULTIPLIERS
from tests.helpers.convert_models import tiny_cfg

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "setting, value",
    [("model__attention", "mla"), ("model__rope_interleave", True)],
)
def test_grouped_query_families_refuse_latent_attention_by_key(setting: str, value: object) -> None:
    """An MLA or interleaved-RoPE model: every grouped-query family names the setting (moetrain
    convert stopped on a bare KeyError once)."""
    from moetrain.convert.formats import problems
    from tests.helpers.configs import tiny_config

    extra = {}
    if value == "mla":
        extra = {f"model__{k}": v for k, v in MLA_SHAPE.items() if k != "attention"}
    cfg = tiny_config(**{setting: value}, **extra)
    for fmt in FORMATS:
        if setting == "model__rope_interleave" and family(fmt).can_hold(
            "model.rope_interleave", True
        ):
            continue  # (ERNIE rotates adjacent pairs: it refuses false instead)
        if family(fmt).can_hold("model.attention", "gqa"):
            assert setting.replace("__", ".") in [k for k, _ in problems(fmt, cfg.model, cfg.moe)]


@pytest.mark.parametrize("setting", list(MULTIPLIERS))
def test_families_without_multipliers_refuse_them_by_key(setting: str) -> None:
    """A muP-style scalar at a non-default value: every family but Granite-MoE names it (MLA
    families: the embedding, residual and logits scalars; MLA refuses model.attention_scale)."""
    from moetrain.convert.formats import problems

    for fmt in FORMATS:
        fam = family(fmt)
        mla = fam.can_hold("model.attention", "mla")
        if fam.can_hold(f"model.{setting}", MULTIPLIERS[setting]) or (
            mla and setting == "attention_scale"
        ):
            continue
        shape = {f"model.{k}": v for k, v in MLA_SHAPE.items()} if mla else {}
        cfg = tiny_config(shape, {f"model.{setting}": MULTIPLIERS[setting]})
        assert f"model.{setting}" in [k for k, _ in problems(fmt, cfg.model, cfg.moe)], fmt
    # and the Granite case itself has all four, exactly
    assert not problems("granitemoe", tiny_cfg("granitemoe").model, tiny_cfg("granitemoe").moe)


def test_latent_attention_refuses_an_attention_scale() -> None:
    """MLA has its own softmax scale (1 / sqrt(qk head dim) times YaRN's mscale)."""
    with pytest.raises(ConfigError, match=r"model\.attention_scale"):
        tiny_config({f"model.{k}": v for k, v in MLA_SHAPE.items()}, model__attention_scale=0.1)


PHIMOE_PIECES = {
    "model.o_bias": {"model.o_bias": True},
    "model.lm_head_bias": {"model.lm_head_bias": True},
    "model.norm": {"model.norm": "layernorm"},
    "moe.router_type": {"moe.router_type": "sparsemixer", "moe.renormalize": False},
}


@pytest.mark.parametrize("setting", list(PHIMOE_PIECES))
def test_families_without_phimoes_pieces_refuse_them_by_key(setting: str) -> None:
    """An attention-output bias, an LM-head bias, LayerNorm or sparsemixer: every family but
    Phi-3.5-MoE names the setting (latent attention refuses model.o_bias itself)."""
    from moetrain.convert.formats import problems

    for fmt in FORMATS:
        mla = family(fmt).can_hold("model.attention", "mla")
        if fmt == "phimoe" or (mla and setting == "model.o_bias"):
            continue
        shape = {f"model.{k}": v for k, v in MLA_SHAPE.items()} if mla else {}
        cfg = tiny_config(shape, PHIMOE_PIECES[setting])
        assert setting in [k for k, _ in problems(fmt, cfg.model, cfg.moe)], fmt


GPT_OSS_PIECES = {
    "model.o_bias": True,
    "model.attention_sinks": True,
    "model.sliding_window": 6,
    "moe.router_bias": True,
    "moe.expert_biases": True,
    "moe.activation": "clamped_swiglu",
}


@pytest.mark.parametrize("setting", list(GPT_OSS_PIECES))
def test_families_without_gpt_oss_pieces_refuse_them_by_key(setting: str) -> None:
    extra = {setting: GPT_OSS_PIECES[setting]}
    if setting == "moe.activation":
        extra |= {"moe.swiglu_alpha": 1.702, "moe.swiglu_limit": 7.0}
    for fmt in FORMATS:
        if family(fmt).can_hold(setting, GPT_OSS_PIECES[setting]):
            continue  # (gpt-oss; Phi-3.5-MoE's output-projection bias, dots.llm1's windows)
        with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
            choose_format(tiny_cfg(fmt, extra), fmt)  # (latent attention: refused at validation)


LLAMA4_PIECES = {
    "model.nope_layers": {"model.nope_layers": [1]},
    "model.attention_chunk_size": {"model.attention_chunk_size": 6},
    "model.qk_norm_after_rope": {"model.qk_norm_after_rope": True},
    "model.attn_temperature_floor": {
        "model.nope_layers": [1],
        "model.attn_temperature_floor": 4,
        "model.attn_temperature_scale": 0.1,
    },
    "moe.score_on_input": {"moe.score_on_input": True},
}


@pytest.mark.parametrize("setting", list(LLAMA4_PIECES))
def test_families_without_llama4s_pieces_refuse_them_by_key(setting: str) -> None:
    """NoPE layers and their temperature, chunked attention, the post-RoPE norm and the
    weights on the experts' inputs: every family but Llama 4 names the setting (latent
    attention refuses the attention ones itself: test_attention_options.py)."""
    from moetrain.convert.formats import problems

    for fmt in FORMATS:
        mla = family(fmt).can_hold("model.attention", "mla")
        if fmt == "llama4_text" or (mla and setting.startswith("model.")):
            continue
        shape = {f"model.{k}": v for k, v in MLA_SHAPE.items()} if mla else {}
        cfg = tiny_config(shape, LLAMA4_PIECES[setting])
        assert setting in [k for k, _ in problems(fmt, cfg.model, cfg.moe)], fmt
