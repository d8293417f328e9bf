"""Every supported Hugging Face format loads in transformers and gives moetrain's logits, and
comes back (config and weights) as it went; each family's own pieces where they bind."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moetrain.config import Config, ConfigError
from moetrain.convert.families import FORMATS, family
from moetrain.convert.formats import choose_format, config_from_hf, hf_config
from moetrain.convert.hf import from_hf_state_dict, to_hf_state_dict
from moetrain.model import Transformer
from tests.helpers.convert_cases import CASES, MULTIPLIERS
from tests.helpers.convert_models import load_hf, model_for, sharpened, stored_model, tiny_cfg
from tests.helpers.routed import assert_every_expert_routed, routed_counts

transformers = pytest.importorskip("transformers")


def test_every_registered_format_has_a_case() -> None:
    assert set(CASES) == set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_logits_match_and_round_trip(tmp_path, fmt: str) -> None:
    cfg = tiny_cfg(fmt)
    assert choose_format(cfg) == fmt
    model = model_for(cfg)
    hf = load_hf(cfg, model, fmt, tmp_path)
    assert type(hf).__name__ == family(fmt).architecture
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), routed_counts(model) as counts:
        ref, got = hf(input_ids=ids).logits, model(ids).logits
    assert_every_expert_routed(fmt, counts)  # (else a broken expert could not show)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert ref.abs().max() > 1e-2
    # HF config -> moetrain config, and both HF layouts (per-expert file, v5 fused) -> moetrain
    back_cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert back_cfg.model == stored_model(cfg)
    for key in (
        "num_experts",
        "top_k",
        "expert_hidden",
        "score_func",
        "renormalize",
        "route_scale",
        "num_shared_experts",
        "shared_expert_gate",
    ):
        assert getattr(back_cfg.moe, key) == getattr(cfg.moe, key), key
    layers = range(cfg.model.n_layers)
    assert [back_cfg.moe.is_moe_layer(i) for i in layers] == [
        cfg.moe.is_moe_layer(i) for i in layers
    ]
    sd = model.state_dict()
    for layout in (to_hf_state_dict(sd, cfg, fmt), hf.state_dict()):
        back = from_hf_state_dict(layout, cfg, fmt)
        assert set(back) == set(sd)
        for k in sd:
            torch.testing.assert_close(back[k], sd[k], atol=0, rtol=0, msg=k)


def test_glm4_group_limited_routing_matches_transformers(tmp_path) -> None:
    """GLM-4.5-style n_group / topk_group: the same logits as transformers' Glm4Moe (with a
    non-zero correction bias), the groups round-trip, and they change this input's routing."""
    cfg = tiny_cfg("glm4_moe", {"moe.num_experts": 8, "moe.n_group": 4, "moe.topk_group": 2})
    assert choose_format(cfg) == "glm4_moe"
    model = model_for(cfg)
    hf = load_hf(cfg, model, "glm4_moe", tmp_path)
    assert (hf.config.n_group, hf.config.topk_group) == (4, 2)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (back.moe.n_group, back.moe.topk_group) == (4, 2)
    ungrouped = dataclasses.replace(cfg.moe, n_group=1, topk_group=1)
    plain = Transformer(cfg.model, ungrouped).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits, got, atol=1e-4)


def test_qwen2_moe_without_a_shared_expert_matches_transformers(tmp_path) -> None:
    """q/k/v biases and no shared expert (an upcycled Qwen2): Qwen2-MoE with a shared expert
    of hidden size 0 (empty tensors, a zero gate), which transformers loads with nothing
    missing and computes as none; read back as no shared expert."""
    no_shared = {"moe.num_shared_experts": 0, "moe.shared_expert_hidden": None}
    cfg = tiny_cfg("qwen2_moe", {**no_shared, "moe.shared_expert_gate": False})
    assert choose_format(cfg) == "qwen2_moe"
    model = model_for(cfg)
    hf = load_hf(cfg, model, "qwen2_moe", tmp_path)
    assert hf.config.shared_expert_intermediate_size == 0
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (back.moe.num_shared_experts, back.moe.shared_expert_gate) == (0, False)
    sd = model.state_dict()
    back_sd = from_hf_state_dict(hf.state_dict(), back, "qwen2_moe")
    assert set(back_sd) == set(sd)


def test_granite_multipliers_change_the_logits_and_match_transformers(tmp_path) -> None:
    """Each of Granite's four scalars changes this model's logits (so the parity test above
    checks them all), and at other values they still match transformers'."""
    cfg = tiny_cfg("granitemoe")
    model = sharpened(model_for(cfg))
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
        for key in MULTIPLIERS:
            plain = Transformer(
                dataclasses.replace(cfg.model, **{key: None if key == "attention_scale" else 1.0}),
                cfg.moe,
            ).eval()
            plain.load_state_dict(model.state_dict())
            assert (plain(ids).logits - got).abs().max() > 1e-4, key
    other = tiny_cfg(
        "granitemoe",
        {
            "model.embedding_multiplier": 3.0,
            "model.residual_multiplier": 0.5,
            "model.attention_scale": 0.3,
            "model.logits_scaling": 0.5,
            "model.tie_embeddings": False,
        },
    )
    model = sharpened(model_for(other))
    hf = load_hf(other, model, "granitemoe", tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["attention_multiplier"], saved["logits_scaling"]) == (0.3, 0.5)
    assert config_from_hf(saved).model == dataclasses.replace(
        other.model, dense_hidden=config_from_hf(saved).model.dense_hidden
    )
    # no attention scale: transformers gets 1 / sqrt(head_dim)
    default = dataclasses.replace(
        other, model=dataclasses.replace(other.model, attention_scale=None)
    )
    assert hf_config(default, "granitemoe").attention_multiplier == 16**-0.5


@pytest.mark.parametrize("fmt", ["granitemoe", "granitemoeshared"])
def test_granite_attention_biases_match_transformers_and_round_trip(tmp_path, fmt) -> None:
    """``attention_bias``: biases on q/k/v/o (nonzero, so each shows in the logits) give
    transformers' logits, and the config reads back with them."""
    cfg = tiny_cfg(fmt, {"model.qkv_bias": True, "model.o_bias": True})
    model = sharpened(model_for(cfg))
    hf = load_hf(cfg, model, fmt, tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attention_bias"] is True
    back = config_from_hf(saved).model
    assert (back.qkv_bias, back.o_bias) == (True, True)


def test_granite_shared_expert_matches_transformers_and_round_trips(tmp_path) -> None:
    """GraniteMoeShared: the shared expert (two of moetrain's merged, 2 x 24) is its
    shared_mlp, read back as one of 48; without one it is GraniteMoe's model, which auto
    picks."""
    cfg = tiny_cfg(
        "granitemoeshared", {"moe.shared_expert_hidden": None, "moe.num_shared_experts": 2}
    )
    assert choose_format(cfg) == "granitemoeshared"
    model = model_for(cfg)
    with torch.no_grad():  # a shared expert that shows in the logits of the tiny model
        for name, p in model.named_parameters():
            if ".shared_expert." in name:
                p.mul_(4.0)
    hf = load_hf(cfg, model, "granitemoeshared", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
        torch.testing.assert_close(got, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        plain = Transformer(cfg.model, dataclasses.replace(cfg.moe, num_shared_experts=0)).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        assert (plain(ids).logits - got).abs().max() > 1e-4
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["shared_intermediate_size"] == 48
    back = config_from_hf(saved).moe
    assert (back.num_shared_experts, back.shared_hidden, back.shared_expert_gate) == (1, 48, False)
    none = tiny_cfg(
        "granitemoeshared", {"moe.num_shared_experts": 0, "moe.shared_expert_hidden": None}
    )
    assert choose_format(none) == "granitemoe"
    assert hf_config(none, "granitemoeshared").shared_intermediate_size == 0
    with pytest.raises(ConfigError, match="shared_intermediate_size"):
        config_from_hf(
            {**saved, "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe"}
        )


def _ernie(extra: dict, tmp_path) -> tuple[Config, Transformer, torch.Tensor, torch.Tensor]:
    """The tiny ERNIE model with ``extra``, its logits in moetrain and in transformers."""
    cfg = tiny_cfg("ernie4_5_moe", extra)
    assert choose_format(cfg) == "ernie4_5_moe"
    model = model_for(cfg)
    hf = load_hf(cfg, model, "ernie4_5_moe", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = model(ids).logits, hf(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    return cfg, model, ids, got


def test_ernie_norm_min_where_it_binds_matches_transformers(tmp_path) -> None:
    """moe.renormalize_min is ERNIE's moe_norm_min: at 0.9, above many tokens' top-2 sums of 4
    experts, transformers' logits, not those of the plain sum; it round-trips."""
    cfg, model, ids, got = _ernie({"moe.renormalize_min": 0.9}, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["moe_norm_min"] == 0.9
    assert config_from_hf(
        json.loads((tmp_path / "config.json").read_text())
    ).moe == dataclasses.replace(cfg.moe, aux_loss_coef=0.0, z_loss_coef=0.0, bias_update_rate=0.0)
    plain = Transformer(cfg.model, dataclasses.replace(cfg.moe, renormalize_min=0.0)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(ids).logits - got).abs().max() > 1e-3


def test_ernie_moe_layer_interval_matches_transformers(tmp_path) -> None:
    """Every second layer MoE (moe.moe_every=2 from layer 0: ERNIE's moe_layer_interval=2) and
    untied embeddings: transformers' logits, and the same layers come back."""
    extra = {"model.n_layers": 4, "model.tie_embeddings": False, "moe.first_k_dense": 0}
    cfg, *_ = _ernie({**extra, "moe.moe_every": 2}, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["moe_layer_start_index"], saved["moe_layer_interval"]) == (0, 2)
    back = config_from_hf(saved)
    assert back.moe.moe_layers(4) == cfg.moe.moe_layers(4) == [1, 3]
    assert back.model == cfg.model


def test_gpt_oss_clamps_and_sinks_where_they_bind_match_transformers(tmp_path) -> None:
    """A limit the tiny model's activations cross and large sinks: transformers' logits, and
    both change them (so the parity above is not blind to them)."""
    cfg = tiny_cfg("gpt_oss", {"moe.swiglu_limit": 0.05, "moe.swiglu_alpha": 3.0})
    model = model_for(cfg)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.sinks.uniform_(1.0, 3.0)
    hf = load_hf(cfg, model, "gpt_oss", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        loose = dataclasses.replace(cfg.moe, swiglu_limit=100.0)
        unclamped = Transformer(cfg.model, loose).eval()
        unclamped.load_state_dict(model.state_dict())
        assert (unclamped(ids).logits - got).abs().max() > 1e-3
        no_sinks = dataclasses.replace(cfg.model, attention_sinks=False)
        plain = Transformer(no_sinks, cfg.moe).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        assert (plain(ids).logits - got).abs().max() > 1e-3


# Llama 4's pieces, off one at a time (the tiny case has them all binding in 19 tokens)
LLAMA4_OFF = {
    "chunks": {"model.attention_chunk_size": None, "model.layer_types": None},
    "nope": {
        "model.nope_layers": None,
        "model.attn_temperature_floor": None,
        "model.attn_temperature_scale": None,
    },
    "temperature": {"model.attn_temperature_floor": None, "model.attn_temperature_scale": None},
    "qk_norm": {"model.qk_norm_after_rope": False},
    "score_on_input": {"moe.score_on_input": False},
}


def test_llama4_pieces_each_bind_in_the_parity_case() -> None:
    """Each of Llama 4's pieces changes the tiny case's logits, so the parity test above
    (transformers' logits, 1e-5) checks every one of them."""
    cfg = tiny_cfg("llama4_text")
    model = model_for(cfg)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
        for name, off in LLAMA4_OFF.items():
            other = tiny_cfg("llama4_text", off)
            plain = Transformer(other.model, other.moe).eval()
            plain.load_state_dict(model.state_dict())
            assert (plain(ids).logits - got).abs().max() > 1e-4, name  # (parity: 1e-5)


@pytest.mark.parametrize(
    "fmt_case",
    [
        "bias",
        pytest.param("tied", marks=pytest.mark.long),
        pytest.param("top1", marks=pytest.mark.long),
    ],
)
def test_llama4_variants_match_transformers_and_round_trip(tmp_path, fmt_case: str) -> None:
    """attention_bias (q/k/v/o biases), tied embeddings, top-1 routing with an explicit MoE
    placement past a dense first layer: transformers' logits, and the config comes back."""
    extra = {
        "bias": {"model.qkv_bias": True, "model.o_bias": True},
        "tied": {"model.tie_embeddings": True, "moe.moe_every": 1},
        "top1": {"moe.top_k": 1, "moe.first_k_dense": 1, "moe.moe_every": 1},
    }[fmt_case]
    cfg = tiny_cfg("llama4_text", extra)
    assert choose_format(cfg) == "llama4_text"
    model = sharpened(model_for(cfg))
    hf = load_hf(cfg, model, "llama4_text", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert back.model == cfg.model
    assert back.moe.moe_layers(3) == cfg.moe.moe_layers(3)
    assert (back.moe.top_k, back.moe.score_on_input) == (cfg.moe.top_k, True)
