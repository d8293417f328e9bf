"""RoPE variants (``model/rope.py``): YaRN's tables equal transformers 5.25's, YaRN's keys are
refused by key when out of range, and both variants (YaRN, interleaved pairs) work for
grouped-query attention too."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from moetrain.config import ConfigError, ModelConfig
from moetrain.model import Transformer
from moetrain.model.rope import (
    model_rope_tables,
    rope_tables,
    softmax_mscale,
    yarn_attention_factor,
    yarn_inv_freq,
    yarn_mscale,
)
from tests.helpers.configs import tiny_config
from tests.helpers.convert_models import sharpened


def _yarn_cfg(dim: int, **keys: object) -> ModelConfig:
    cfg = ModelConfig(
        d_model=4 * dim, n_heads=4, n_kv_heads=4, max_seq_len=300, rope_scaling="yarn", **keys
    )
    cfg.validate()
    return cfg


def _hf_tables(cfg: ModelConfig, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
    hc = LlamaConfig(
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "yarn", **rope},
    )
    x = torch.zeros(1)
    cos, sin = LlamaRotaryEmbedding(hc)(x, torch.arange(cfg.max_seq_len)[None])
    return cos[0], sin[0]


CASES = [  # head dim, the YaRN keys (moetrain's rope_<key>; transformers' names but one)
    (16, dict(factor=4.0, original_max_seq_len=1024)),
    (64, dict(factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0)),
    (128, dict(factor=16.0, original_max_seq_len=256, mscale=0.707, mscale_all_dim=0.707)),
    (32, dict(factor=8.0, original_max_seq_len=2048, mscale=1.0, mscale_all_dim=0.5)),
    (32, dict(factor=2.0, original_max_seq_len=64, beta_fast=24.0, beta_slow=2.0)),
    (64, dict(factor=4.0, original_max_seq_len=32768, mscale=0.8)),  # mscale alone
    (16, dict(factor=1.0, original_max_seq_len=64)),
    # Kimi K2 as released: equal bounds (a one-dim ramp between the floored and ceiled dims)
    (64, dict(factor=32.0, original_max_seq_len=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0)),
]


@pytest.mark.parametrize(("dim", "keys"), CASES)
def test_yarn_tables_equal_transformers(dim: int, keys: dict) -> None:
    cfg = _yarn_cfg(dim, rope_theta=50000.0, **{f"rope_{k}": v for k, v in keys.items()})
    rope = {
        k.replace("original_max_seq_len", "original_max_position_embeddings"): v
        for k, v in keys.items()
    }
    want_cos, want_sin = _hf_tables(cfg, rope)
    cos, sin = model_rope_tables(cfg)
    torch.testing.assert_close(cos, want_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=1e-6, atol=1e-6)


# a beta whose correction dim is whole (8.0 exactly): floor == ceil with truncation
WHOLE_DIM_BETA = 4096 / (2 * math.pi * 2**8)


@pytest.mark.parametrize(
    ("dim", "original", "theta", "beta", "truncate"),
    [
        (64, 4096, 50000.0, 1.0, True),  # Kimi K2's rotary dims, theta, context and betas
        (64, 4096, 50000.0, 1.0, False),  # the bounds coincide
        (32, 4096, 65536.0, WHOLE_DIM_BETA, True),  # floor and ceil of a whole dim coincide
    ],
)
def test_yarn_equal_betas_compute_what_transformers_computes(
    dim: int, original: int, theta: float, beta: float, truncate: bool
) -> None:
    """``beta_fast == beta_slow`` (Kimi K2, K2-Thinking, K2.5's text tower): the ramp between
    equal bounds, bit for bit transformers' ``_compute_yarn_parameters`` (where the bounds
    coincide both widen the ramp by 0.001)."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    keys = dict(rope_factor=32.0, rope_beta_fast=beta, rope_beta_slow=beta, rope_truncate=truncate)
    cfg = _yarn_cfg(dim, rope_theta=theta, rope_original_max_seq_len=original, **keys)
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": 32.0, "truncate": truncate}
    rope |= {"beta_fast": beta, "beta_slow": beta, "original_max_position_embeddings": original}
    hc = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, rope_parameters=rope)
    want, factor = _compute_yarn_parameters(hc)
    got = yarn_inv_freq(dim, theta, 32.0, original, beta, beta, truncate=truncate)
    assert torch.equal(got, want)
    assert yarn_attention_factor(cfg) == factor
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert not torch.allclose(got, plain) and not torch.allclose(got, plain / 32)  # a ramp


def test_yarn_factor_one_is_plain_rope_and_mscale_needs_mscale_all_dim() -> None:
    cfg = _yarn_cfg(32, rope_factor=1.0, rope_original_max_seq_len=64, rope_mscale_all_dim=1.0)
    for got, want in zip(model_rope_tables(cfg), rope_tables(32, 300, cfg.rope_theta), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # (fp32 angles, rounded)
    assert softmax_mscale(cfg) == 1.0
    cfg = _yarn_cfg(32, rope_factor=40.0, rope_original_max_seq_len=64, rope_mscale_all_dim=0.5)
    assert softmax_mscale(cfg) == pytest.approx(yarn_mscale(40.0, 0.5) ** 2)
    assert softmax_mscale(dataclasses.replace(cfg, rope_mscale_all_dim=None)) == 1.0


def test_grouped_query_attention_uses_yarn_tables() -> None:
    cfg = tiny_config(
        {"model.rope_scaling": "yarn", "model.rope_factor": 8.0},
        {"model.rope_original_max_seq_len": 16, "model.rope_mscale": 0.9},
    )
    model = Transformer(cfg.model, cfg.moe)
    cos, sin = model_rope_tables(cfg.model)
    plain_cos, _ = rope_tables(cfg.model.attention_head_dim, 64, cfg.model.rope_theta)
    assert not torch.allclose(cos, plain_cos)  # the case is not trivial
    torch.testing.assert_close(model.rope_cos, cos, rtol=0, atol=0)
    model.rope_cos.zero_()
    model.rope_sin.zero_()
    model.reset_rope()  # (after a meta-device build) recomputes YaRN's tables
    torch.testing.assert_close(model.rope_sin, sin, rtol=0, atol=0)


def test_interleaved_pairs_are_the_half_layout_with_permuted_rows() -> None:
    """Grouped-query attention with ``model.rope_interleave``: the same logits as the half
    layout, once each q/k head's rows are reordered to adjacent pairs."""
    torch.manual_seed(0)
    cfg = tiny_config()
    half = Transformer(cfg.model, cfg.moe).eval()
    pairs = Transformer(dataclasses.replace(cfg.model, rope_interleave=True), cfg.moe).eval()
    hd = cfg.model.attention_head_dim
    order = torch.stack((torch.arange(hd // 2), torch.arange(hd // 2, hd)), dim=1).flatten()
    state = half.state_dict()
    for key, w in list(state.items()):
        if key.endswith(("attn.wq.weight", "attn.wk.weight")):
            state[key] = w.view(-1, hd, w.shape[-1])[:, order].reshape(w.shape)
    pairs.load_state_dict(state)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 20))
    with torch.no_grad():
        want = half(ids).logits
        torch.testing.assert_close(pairs(ids).logits, want, rtol=1e-5, atol=1e-6)
        unpermuted = Transformer(pairs.cfg, cfg.moe).eval()
        unpermuted.load_state_dict(half.state_dict())
        assert not torch.allclose(unpermuted(ids).logits, want, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.rope_factor": 0.5}, "model.rope_factor"),
        ({"model.rope_factor": None}, "model.rope_factor"),
        ({"model.rope_original_max_seq_len": None}, "model.rope_original_max_seq_len"),
        ({"model.rope_original_max_seq_len": 0}, "model.rope_original_max_seq_len"),
        ({"model.rope_beta_fast": 0.5}, "model.rope_beta_fast"),  # below beta_slow (1)
        ({"model.rope_beta_fast": 4.0, "model.rope_beta_slow": 8.0}, "model.rope_beta_fast"),
        ({"model.rope_beta_slow": 0.0}, "model.rope_beta_slow"),
        ({"model.rope_mscale": 0.0}, "model.rope_mscale"),
        ({"model.rope_mscale_all_dim": -1.0}, "model.rope_mscale_all_dim"),
        ({"model.rope_factor": float("inf")}, "model.rope_factor"),
        ({"model.rope_scaling": "linear"}, "model.rope_scaling"),
        ({"model.rope_scaling": "none"}, "model.rope_factor"),  # a YaRN key without YaRN
    ],
)
def test_yarn_keys_out_of_range_are_refused_by_key(overrides: dict, key: str) -> None:
    yarn = {"model.rope_scaling": "yarn", "model.rope_factor": 4.0}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(yarn, {"model.rope_original_max_seq_len": 16}, overrides)


def test_a_yarn_key_without_yarn_is_refused_whichever_it_is() -> None:
    for key in ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim"):
        with pytest.raises(ConfigError, match=rf"model\.{key}: only applies"):
            ModelConfig(**{key: 2.0}).validate()


def _longrope_cfg(**keys: object) -> ModelConfig:
    cfg = ModelConfig(
        d_model=64,
        n_heads=4,
        n_kv_heads=4,
        max_seq_len=1024,
        rope_scaling="longrope",
        rope_original_max_seq_len=256,
        rope_short_factor=[1.0 + 0.5 * i for i in range(8)],
        rope_long_factor=[2.0 + i for i in range(8)],
        **keys,
    )
    cfg.validate()
    return cfg


@pytest.mark.parametrize("attention_factor", [None, 1.243163121016122])
def test_longrope_tables_equal_transformers_short_and_long_factors(attention_factor) -> None:
    """LongRoPE's tables are transformers' for sequences within the original context (the short
    factors) and beyond it (the long ones, at every position), with its default attention
    factor sqrt(1 + ln(s) / ln(original)) or a given one."""
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    cfg = _longrope_cfg(rope_attention_factor=attention_factor)
    rope = {
        "rope_type": "longrope",
        "rope_theta": cfg.rope_theta,
        "short_factor": cfg.rope_short_factor,
        "long_factor": cfg.rope_long_factor,
        "original_max_position_embeddings": cfg.rope_original_max_seq_len,
    }
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    hc = LlamaConfig(
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters=rope,
    )
    inv_freq, factor = _compute_longrope_parameters(hc, seq_len=cfg.rope_original_max_seq_len)
    assert factor == pytest.approx(cfg.longrope_attention_factor, rel=1e-12)
    assert factor == attention_factor or factor == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(256))
    )
    emb = LlamaRotaryEmbedding(hc)
    for n, long in ((256, False), (300, True)):  # within the original context, then past it
        assert cfg.longrope_long(n) is long
        cos, sin = model_rope_tables(cfg, n, long=long)
        assert cos.shape == (n, 16)
        want_cos, want_sin = emb(torch.zeros(1), torch.arange(n)[None])
        torch.testing.assert_close(cos, want_cos[0], atol=0, rtol=0)
        torch.testing.assert_close(sin, want_sin[0], atol=0, rtol=0)
    freqs = torch.outer(torch.arange(256.0), inv_freq)  # the short table by hand
    torch.testing.assert_close(
        model_rope_tables(cfg, 256)[0], torch.cat((freqs, freqs), -1).cos() * factor
    )
    short, long = model_rope_tables(cfg, 300), model_rope_tables(cfg, 300, long=True)
    assert (short[0] - long[0]).abs().max() > 0.1  # the factors differ where it matters


TINY_LONGROPE = {
    "model.max_seq_len": 128,
    "model.rope_scaling": "longrope",
    "model.rope_original_max_seq_len": 16,
    "model.rope_short_factor": [1.0] * 4,
    "model.rope_long_factor": [4.0] * 4,
    "model.rope_attention_factor": 1.2,
    "data.seq_len": 32,
}


def _logits(cfg, state: dict, ids: torch.Tensor) -> torch.Tensor:
    model = Transformer(cfg.model, cfg.moe).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(ids).logits


def test_longrope_picks_its_factors_by_the_sequence_length() -> None:
    """A sequence within the original context computes with the short factors, a longer one
    with the long factors at every position (the same model with those as its short factors
    and a longer original context), or with the short ones still under
    ``model.rope_long_regime: short``."""
    cfg = tiny_config(TINY_LONGROPE)
    torch.manual_seed(0)
    state = sharpened(Transformer(cfg.model, cfg.moe)).state_dict()  # positions show
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    wide = {"model.rope_original_max_seq_len": 64}  # 24 tokens within it: its short factors
    short = tiny_config(TINY_LONGROPE, wide)
    long = tiny_config(TINY_LONGROPE, wide, {"model.rope_short_factor": [4.0] * 4})
    got = _logits(cfg, state, ids)
    torch.testing.assert_close(got, _logits(long, state, ids), rtol=0, atol=0)
    assert (got - _logits(short, state, ids)).abs().max() > 1e-3
    within = _logits(cfg, state, ids[:, :16])  # 16 positions: the short factors
    torch.testing.assert_close(within, _logits(short, state, ids[:, :16]), rtol=0, atol=0)
    kept = tiny_config(TINY_LONGROPE, {"model.rope_long_regime": "short"})
    torch.testing.assert_close(_logits(kept, state, ids), _logits(short, state, ids))


def test_longrope_keys_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"model\.rope_short_factor"):
        tiny_config(TINY_LONGROPE, {"model.rope_short_factor": [1.0] * 3})
    with pytest.raises(ConfigError, match=r"model\.rope_long_factor"):
        tiny_config(TINY_LONGROPE, {"model.rope_long_factor": None})
    with pytest.raises(ConfigError, match=r"model\.rope_short_factor"):
        tiny_config({"model.rope_short_factor": [1.0] * 4})  # (without longrope)
    with pytest.raises(ConfigError, match=r"model\.rope_long_regime"):
        tiny_config({"model.rope_long_regime": "short"})  # (without longrope)
    with pytest.raises(ConfigError, match=r"model\.rope_long_regime"):
        tiny_config(TINY_LONGROPE, {"model.rope_long_regime": "middle"})


@pytest.mark.parametrize("key", ["model.rope_short_factor", "model.rope_long_factor"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -1.0])
def test_longrope_factors_must_be_positive_and_finite(key: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ": .*positive finite"):
        tiny_config(TINY_LONGROPE, {key: [1.0, 1.0, bad, 1.0]})


def test_rope_tables_are_built_for_the_positions_used() -> None:
    """A long context (Llama 4 Scout's is 10M positions) builds its tables for the first 8192
    positions and grows them, exactly, when a forward reaches further (here a cache at 10000)."""
    from moetrain.model.transformer import ROPE_TABLE_ROWS

    cfg = tiny_config(
        {
            "model.max_seq_len": 40000,
            "model.rope_scaling": "llama3",
            "model.rope_factor": 16.0,
            "model.rope_original_max_seq_len": 16,
            "model.rope_low_freq_factor": 1.0,
            "model.rope_high_freq_factor": 1.0,
        }
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    assert model.rope_cos.shape[0] == ROPE_TABLE_ROWS == 8192
    cache = model.new_cache(1, 10001)
    cache.pos = 10000
    with torch.no_grad():
        model(torch.tensor([[5]]), cache=cache)
    assert model.rope_cos.shape[0] == 16384
    want_cos, want_sin = model_rope_tables(cfg.model)
    torch.testing.assert_close(model.rope_cos, want_cos[:16384], rtol=0, atol=0)
    torch.testing.assert_close(model.rope_sin, want_sin[:16384], rtol=0, atol=0)
    model.rope_rows(40000)  # (never past the context)
    assert model.rope_cos.shape[0] == 40000
