"""Scaled RoPE (YaRN, Llama 3.1's, LongRoPE) in every grouped-query format: transformers'
logits, and the rope_parameters back as they went; an unknown rope type refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.convert.families import FORMATS, family
from moetrain.convert.formats import config_from_hf, hf_config
from moetrain.model import Transformer
from tests.helpers.convert_cases import CASES
from tests.helpers.convert_models import load_hf, model_for, sharpened, stored_model, tiny_cfg

transformers = pytest.importorskip("transformers")


SCALED_ROPE = {
    "yarn": {
        "model.rope_scaling": "yarn",
        "model.rope_factor": 4.0,
        "model.rope_original_max_seq_len": 16,
        "model.rope_beta_fast": 24.0,
    },
    "llama3": {
        "model.rope_scaling": "llama3",
        "model.rope_factor": 8.0,
        "model.rope_original_max_seq_len": 16,
        "model.rope_low_freq_factor": 1.0,
        "model.rope_high_freq_factor": 4.0,
    },
    "longrope": {  # (60 tokens take the long factors, the first 30 alone the short ones)
        "model.rope_scaling": "longrope",
        "model.rope_original_max_seq_len": 32,
        "model.rope_short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
        "model.rope_long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0],
        "model.rope_attention_factor": 1.3,
    },
}


# the rope types of each grouped-query family (Phi-3.5-MoE multiplies any scaled RoPE by its
# short_mscale: plain and LongRoPE only)
SCALED_CASES = [
    (fmt, scaling)
    for fmt in FORMATS
    if family(fmt).can_hold("model.attention", "gqa")
    for scaling in SCALED_ROPE
    if family(fmt).can_hold("model.rope_scaling", scaling)  # (Nemotron-H's attention: no RoPE)
    if fmt != "phimoe" or scaling == "longrope"
    if family(fmt).can_hold("model.rope_scaling", scaling)  # (Gemma 4's: plain RoPE)
]


# Granite's released attention scale (1/64) leaves the tiny random model's attention nearly
# uniform, where positions hardly show: a sharper one, so that the scaling changes the logits
SHARP_ATTENTION = dict.fromkeys(
    ("granitemoe", "granitemoeshared", "granitemoehybrid"), {"model.attention_scale": 16.0}
)


@pytest.mark.parametrize(("fmt", "scaling"), SCALED_CASES)
def test_scaled_rope_matches_transformers_and_round_trips(tmp_path, fmt: str, scaling) -> None:
    """YaRN, Llama 3.1's and LongRoPE's RoPE scaling in every grouped-query family:
    transformers' logits (the scaling changes them), and the rope_parameters come back as they
    went."""
    sharp = SHARP_ATTENTION.get(fmt, {})
    keys = dict(SCALED_ROPE[scaling])
    pairs = tiny_cfg(fmt).model.rope_dim // 2
    for key in ("model.rope_short_factor", "model.rope_long_factor"):  # (rope_dim / 2 each)
        if key in keys:
            keys[key] = keys[key][:pairs]
    off = {}  # the scaling replaces the case's own (gpt-oss's YaRN)
    yarn_only = ("rope_beta_fast", "rope_beta_slow", "rope_truncate")
    if scaling != "yarn":
        yarn_only += ("rope_factor",) if "model.rope_factor" not in keys else ()
        off = {f"model.{k}": None for k in yarn_only if k in CASES[fmt]["model"]}
    cfg = tiny_cfg(fmt, {**keys, **sharp, **off})
    model = sharpened(model_for(cfg))  # positions show in the logits (gpt-oss's windows)
    hf = load_hf(cfg, model, fmt, tmp_path)
    assert hf.config.rope_parameters["rope_type"] == scaling
    ids = torch.randint(0, 96, (2, 60), generator=torch.Generator().manual_seed(0))
    unscaled = {}  # the case's own scaling (gpt-oss's YaRN) off too
    if "rope_scaling" in CASES[fmt]["model"]:
        own = [k for k in CASES[fmt]["model"] if k.startswith("rope_") and k != "rope_scaling"]
        unscaled = {f"model.{k}": None for k in own}
        unscaled["model.rope_scaling"] = "none"
    plain = Transformer(tiny_cfg(fmt, {**sharp, **unscaled}).model, cfg.moe).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
        assert (plain(ids).logits - got).abs().max() > 1e-4  # well above the tolerance below
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if scaling == "longrope":  # a sequence within the original context: the short factors
        _longrope_regimes_match(model, hf, ids, cfg)
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert back.model == stored_model(cfg)
    for key in SCALED_ROPE[scaling]:
        name = key.removeprefix("model.")
        assert getattr(back.model, name) == getattr(cfg.model, name), key


def _longrope_regimes_match(model: Transformer, hf, ids: torch.Tensor, cfg) -> None:  # noqa: ANN001
    """Within the original context (30 of 32 positions) transformers' logits too; past it (60),
    the other regime would differ well above the tolerance."""
    with torch.no_grad():
        within = ids[:, :30]
        torch.testing.assert_close(
            model(within).logits, hf(input_ids=within).logits, atol=1e-5, rtol=1e-5
        )
        other = "long" if cfg.model.rope_long_regime == "short" else "short"
        swapped = dataclasses.replace(cfg.model, rope_long_regime=other)
        twin = Transformer(swapped, cfg.moe).eval()
        twin.load_state_dict(model.state_dict())
        assert (twin(ids).logits - model(ids).logits).abs().max() > 1e-4


def test_unknown_rope_type_is_refused_by_name() -> None:
    d = hf_config(tiny_cfg("mixtral"), "mixtral").to_dict()
    d["architectures"] = ["MixtralForCausalLM"]
    d["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigError, match=r"rope_parameters\.rope_type: .*'dynamic'"):
        config_from_hf(d)
