"""The layer plan (``moetrain.config.layer_plan``): today's keys give the layers they always
gave, the released patterns are expressible, bad plans are refused by key, and a block of a
mixer alone or an FFN alone (Nemotron-H's layers) builds, runs and counts."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.config.layer_plan import (
    CHUNKED,
    FULL,
    LINEAR,
    SLIDING,
    LayerSpec,
    MixerSpec,
    layer_types,
)
from moetrain.model import Transformer
from moetrain.model.mixers import MixerInputs
from moetrain.model_numbers import model_numbers
from moetrain.plan import activation_bytes_per_token, head_bytes_per_token
from tests.helpers.configs import tiny_config
from tests.helpers.memory import saved_storages


def _plan(*overrides: dict) -> list[tuple[MixerSpec | None, str]]:
    return [(s.mixer, s.ffn) for s in tiny_config(*overrides).layer_plan()]


def test_moe_placement_keys_place_the_ffns() -> None:
    cfg = tiny_config({"model.n_layers": 6, "moe.first_k_dense": 1, "moe.moe_every": 2})
    assert [s.ffn for s in cfg.layer_plan()] == ["dense", "dense", "moe", "dense", "moe", "dense"]
    assert cfg.moe.moe_layers(6) == [2, 4]
    mtp = tiny_config({"model.mtp_depth": 2, "moe.first_k_dense": 1})
    plan = mtp.layer_plan()
    assert [(s.index, s.ffn, s.mtp) for s in plan] == [
        (0, "dense", False),
        (1, "moe", False),
        (2, "moe", True),
        (3, "moe", True),
    ]
    assert all(s.mixer == MixerSpec("gqa") for s in plan)


def test_attention_keys_give_each_layer_its_options() -> None:
    llama4 = {
        "model.n_layers": 4,
        "model.attention_chunk_size": 8,
        "model.layer_types": [CHUNKED, CHUNKED, CHUNKED, FULL],
        "model.nope_layers": [3],
        "model.attn_temperature_floor": 8,
        "model.attn_temperature_scale": 0.1,
    }
    chunked = MixerSpec("gqa", chunk=8)
    nope = MixerSpec("gqa", rope=False, temperature=(8, 0.1))
    assert _plan(llama4) == [(chunked, "moe")] * 3 + [(nope, "moe")]
    window = {"model.n_layers": 3, "model.sliding_window": 5}
    assert _plan(window) == [(MixerSpec("gqa", window=5), "moe")] * 3
    gpt_oss = {**window, "model.layer_types": [SLIDING, FULL, SLIDING]}
    assert [m.window for m, _ in _plan(gpt_oss)] == [5, None, 5]
    cfg = tiny_config(gpt_oss).model
    assert [cfg.attention_window(i) for i in range(3)] == [5, None, 5]


def test_full_attention_interval_is_qwen3_next_pattern() -> None:
    cfg = tiny_config({"model.n_layers": 8}).model
    cfg.full_attention_interval = 4
    assert layer_types(cfg) == [LINEAR, LINEAR, LINEAR, FULL] * 2
    # the pattern's first full-attention layer must be in the model
    with pytest.raises(ConfigError, match=r"model\.full_attention_interval: the pattern is lo"):
        tiny_config({"model.full_attention_interval": 4})
    # its linear_attention layers need their kind's keys
    with pytest.raises(ConfigError, match=r"model\.linear_num_key_heads: must be set"):
        tiny_config({"model.full_attention_interval": 2})
    assert _plan({"model.full_attention_interval": 1}) == _plan()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.layer_types": [FULL, "mamba"]}, "model.layer_types"),
        ({"model.layer_types": [FULL]}, "model.layer_types"),
        ({"model.layer_types": [FULL, FULL], "model.full_attention_interval": 1}, "interval"),
        ({"moe.layer_ffns": ["moe"]}, "moe.layer_ffns"),
        ({"moe.layer_ffns": ["moe", "dense"], "moe.first_k_dense": 1}, "moe.layer_ffns"),
        ({"moe.layer_ffns": ["moe", "big"]}, "moe.layer_ffns"),
        ({"model.layer_types": ["none", FULL], "moe.layer_ffns": ["none", "moe"]}, "layer_types"),
        ({"model.attention": "linear"}, "model.attention"),
    ],
)
def test_bad_plans_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(overrides)


NEMOTRON = {  # mixer-only and FFN-only blocks, as Nemotron-H's "*-E" and MTP after them
    "model.n_layers": 4,
    "model.layer_types": [FULL, "none", FULL, "none"],
    "moe.layer_ffns": ["none", "dense", "none", "moe"],
    "model.mtp_depth": 1,
}


def test_blocks_of_a_mixer_alone_or_an_ffn_alone() -> None:
    cfg = tiny_config(NEMOTRON)
    assert [(s.mixer is not None, s.ffn) for s in cfg.layer_plan()] == [
        (True, "none"),
        (False, "dense"),
        (True, "none"),
        (False, "moe"),
        (True, "moe"),  # the MTP block: full attention, an MoE FFN
    ]
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    names = {n.split(".")[2] for n, _ in model.named_parameters() if n.startswith("layers.")}
    assert names >= {"attn_norm", "attn", "ffn_norm", "ffn"}
    for i, (has_mixer, has_ffn) in enumerate([(1, 0), (0, 1), (1, 0), (0, 1)]):
        own = {n.split(".")[2] for n, _ in model.named_parameters() if n.startswith(f"layers.{i}.")}
        assert own == ({"attn_norm", "attn"} if has_mixer else set()) | (
            {"ffn_norm", "ffn"} if has_ffn else set()
        )
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12))
    out = model(ids, labels_BS=ids)
    assert len(out.moe) == 2 and torch.isfinite(out.loss)
    # each block adds only what it has: the whole model by hand
    with torch.no_grad():
        x = model.embed(ids)
        inputs = MixerInputs(model.rope_cos[:12], model.rope_sin[:12])
        for block in model.layers[:4]:
            if block.attn is not None:
                x = x + block.attn(block.attn_norm(x), inputs)
            if block.ffn is not None:
                y = block.ffn(block.ffn_norm(x))
                x = x + (y[0] if block.is_moe else y)
        torch.testing.assert_close(model.head(model.norm(x)), model(ids).logits)


def test_counts_follow_the_blocks_the_plan_builds() -> None:
    """Parameters, and the bytes saved for backward against saved-tensor hooks, for blocks of
    a mixer alone and of an FFN alone."""
    cfg = tiny_config(NEMOTRON, {"model.mtp_depth": 0, "model.loss_chunk_tokens": 128})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    assert model_numbers(cfg).total_params == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.model.vocab_size, (4, 32))
    with saved_storages([*model.parameters(), *model.buffers()]) as seen:
        model(ids, labels_BS=ids, return_logits=False)
    tokens = ids.numel()
    predicted = sum(activation_bytes_per_token(cfg, i, 4) for i in range(4))
    predicted += head_bytes_per_token(cfg, 4) - 8  # (the labels are the ids: counted once)
    predicted += 4 * cfg.model.vocab_size * cfg.model.d_model / tokens  # the head's fp32 grad
    assert sum(seen.values()) / tokens == pytest.approx(predicted, rel=0.01)
    assert activation_bytes_per_token(cfg, 1, 4) < activation_bytes_per_token(cfg, 3, 4)


def test_a_layer_spec_builds_the_block_it_says() -> None:
    cfg = tiny_config()
    from moetrain.model.block import Block

    mixer_only = Block(LayerSpec(0, MixerSpec("gqa"), "none"), cfg.model, cfg.moe)
    ffn_only = Block(LayerSpec(1, None, "dense"), cfg.model, cfg.moe)
    assert mixer_only.ffn is None and mixer_only.ffn_norm is None and mixer_only.attn is not None
    assert ffn_only.attn is None and ffn_only.attn_norm is None and ffn_only.ffn is not None


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (NEMOTRON, "model.layer_types"),
        ({"moe.layer_ffns": ["moe", "moe"]}, "moe.layer_ffns"),  # same layers, other keys
    ],
)
def test_no_hugging_face_family_takes_a_plan_it_cannot_hold(overrides: dict, key: str) -> None:
    from moetrain.convert.families import FORMATS
    from moetrain.convert.formats import problems

    cfg = tiny_config(overrides)
    for fmt in FORMATS:
        keys = [k for k, _ in problems(fmt, cfg.model, cfg.moe)]
        if fmt == "nemotron_h":  # blocks of one sublayer each: it holds the first plan alone
            assert ("model.layer_types" in keys) == (key != "model.layer_types"), keys
        else:
            assert key in keys, fmt
