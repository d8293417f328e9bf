"""Llama 4's attention options, each against an explicit reference written from transformers'
formulas: NoPE layers (``model.nope_layers``), the weightless query/key norm after RoPE
(``model.qk_norm_after_rope``), the NoPE layers' query temperature
(``model.attn_temperature_floor`` / ``attn_temperature_scale``) at row positions, with packed
documents and the KV cache; RoPE as complex pairs (``model.rope_interleave``); Llama 3.1's RoPE
scaling with equal frequency factors (Llama 4's); and the config rules, refused by key."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moetrain.config import ConfigError, ModelConfig
from moetrain.config.layer_plan import mixer_spec
from moetrain.model import Transformer
from moetrain.model.attention import temperature
from moetrain.model.doc_attention import Documents
from moetrain.model.mixers import MixerInputs
from moetrain.model.mixers.gqa import Attention
from moetrain.model.rope import rope_tables
from tests.helpers.configs import tiny_config
from tests.helpers.decoding import logits_through_cache

LLAMA4 = {
    "model.n_layers": 4,
    "model.rope_interleave": True,
    "model.nope_layers": [1, 3],
    "model.qk_norm_after_rope": True,
    "model.attn_temperature_floor": 3,
    "model.attn_temperature_scale": 0.7,
    "model.rope_theta": 500.0,
}


def reference(attn: Attention, cfg: ModelConfig, x, pos, allowed, chunk=None) -> torch.Tensor:
    """Llama 4's attention written out: RoPE as complex multiplication of adjacent pairs on a
    RoPE layer, then the weightless RMSNorm of q and k; on a NoPE layer the queries times
    ``log1p(floor((p + 1) / floor)) * scale + 1``; softmax over the causal positions of
    ``allowed`` (B, S, S) (and of the chunk)."""
    b, s, _ = x.shape
    h, g, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, s, h, hd)
    k = (x @ attn.wk.weight.T).view(b, s, g, hd)
    v = (x @ attn.wv.weight.T).view(b, s, g, hd)
    if attn.rope:
        # (in fp32, as transformers and moetrain's tables compute them)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        freqs = pos[:, None].float() * inv
        cis = torch.complex(freqs.cos().double(), freqs.sin().double())

        def rotate(t):
            c = torch.view_as_complex(t.reshape(*t.shape[:-1], hd // 2, 2).contiguous())
            return torch.view_as_real(c * cis[None, :, None]).flatten(3)

        q, k = rotate(q), rotate(k)
        if cfg.qk_norm_after_rope:
            eps = cfg.norm_eps
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    elif cfg.attn_temperature_floor is not None:
        floor, scale = cfg.attn_temperature_floor, cfg.attn_temperature_scale
        t = torch.log1p(torch.floor((pos.float() + 1) / floor)) * scale + 1  # (fp32, as theirs)
        q = q * t.double()[None, :, None, None]
    k, v = (t.repeat_interleave(h // g, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = (pos[None, :] <= pos[:, None]) & allowed
    if chunk is not None:
        mask = mask & (pos[None, :] // chunk == pos[:, None] // chunk)
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * hd)
    return out @ attn.wo.weight.T


def _attention(layer: int, **extra) -> tuple[Attention, ModelConfig]:
    cfg = tiny_config({**LLAMA4, **extra}).model
    torch.manual_seed(layer)
    attn = Attention(cfg, mixer_spec(cfg, layer)).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.4)
    return attn, cfg


def _tables(cfg: ModelConfig):
    cos, sin = rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
    return cos.double(), sin.double()


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("layer", [0, 1], ids=["rope", "nope"])
def test_layer_matches_the_written_out_attention(layer: int, chunk: int | None) -> None:
    """Values and gradients, one sequence and packed documents (temperature at the row's
    positions, chunks on the row's grid)."""
    extra = {"model.attention_chunk_size": chunk} if chunk else {}
    attn, cfg = _attention(layer, **extra)
    assert attn.rope == (layer == 0) and (attn.temperature is not None) == (layer == 1)
    x = torch.randn(2, 23, cfg.d_model, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(cfg)
    pos = torch.arange(23)
    doc_ids = torch.tensor([[0] * 9 + [1] * 14, [0] * 23])
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    docs = Documents.from_ids(doc_ids)  # (a chunked layer cuts them at its chunks)
    for mask, allowed in ((None, torch.ones_like(same)), (docs, same)):
        got = attn(x, MixerInputs(cos, sin, mask, None if mask is None else doc_ids))
        want = reference(attn, cfg, x, pos, allowed, chunk)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        grad = torch.randn_like(got)
        params = [x, *attn.parameters()]
        for a, b in zip(
            torch.autograd.grad(got, params, grad),
            torch.autograd.grad(want, params, grad),
            strict=True,
        ):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_each_option_binds() -> None:
    """NoPE, the norm and the temperature each change the layer's output."""
    x = torch.randn(1, 23, 32, dtype=torch.float64)
    for layer, off in (
        (1, {"model.nope_layers": [3]}),
        (0, {"model.qk_norm_after_rope": False}),
        (1, {"model.attn_temperature_floor": None, "model.attn_temperature_scale": None}),
    ):
        attn, cfg = _attention(layer)
        other, _ = _attention(layer, **off)
        other.load_state_dict(attn.state_dict())
        cos, sin = _tables(cfg)
        inputs = MixerInputs(cos, sin)
        assert (attn(x, inputs) - other(x, inputs)).abs().max() > 1e-3, off


def test_temperature_is_llama4s_formula() -> None:
    got = temperature(5, 20, 8, 0.1, torch.device("cpu"))
    pos = torch.arange(5, 25, dtype=torch.float32)
    torch.testing.assert_close(got, torch.log1p(torch.floor((pos + 1) / 8)) * 0.1 + 1)
    assert got[0] == 1.0 and got[-1] == pytest.approx(1 + 0.1 * math.log(4))


def test_model_cache_continues_the_positions() -> None:
    """Every piece on (chunks too): the KV cache's logits, prompt then one token and several
    at a time, equal the full forward's, and one document per row equals none."""
    cfg = tiny_config(
        {
            **LLAMA4,
            "model.attention_chunk_size": 5,
            "model.layer_types": ["chunked_attention", "full_attention"] * 2,
        }
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        full = model(ids).logits
        cached = logits_through_cache(model, ids, 8, 5)
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            model(ids, doc_ids_BS=torch.zeros_like(ids)).logits, full, atol=1e-5, rtol=1e-5
        )


def test_llama3_rope_with_equal_frequency_factors_equals_transformers() -> None:
    """Llama 4's released llama3 scaling has low_freq_factor == high_freq_factor == 1: a step
    (wavelengths past original / 1 divided by the factor, the others kept), as transformers
    computes it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = dict(factor=16.0, original_max_position_embeddings=16, low_freq_factor=1.0)
    cfg = tiny_config(
        {
            "model.rope_scaling": "llama3",
            "model.rope_factor": 16.0,
            "model.rope_original_max_seq_len": 16,
            "model.rope_low_freq_factor": 1.0,
            "model.rope_high_freq_factor": 1.0,
            "model.rope_theta": 500000.0,
        }
    ).model
    hc = LlamaConfig(
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={
            "rope_theta": 500000.0,
            "rope_type": "llama3",
            **rope,
            "high_freq_factor": 1.0,
        },
    )
    want_cos, want_sin = LlamaRotaryEmbedding(hc)(torch.zeros(1), torch.arange(64)[None])
    cos, sin = rope_tables(cfg.rope_dim, 64, cfg.rope_theta, cfg)
    torch.testing.assert_close(cos, want_cos[0])
    torch.testing.assert_close(sin, want_sin[0])
    plain = rope_tables(cfg.rope_dim, 64, cfg.rope_theta)[0]
    assert (plain - cos).abs().max() > 1e-3  # some wavelengths are divided


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"model.nope_layers": [4]}, "model.nope_layers"),
        ({"model.nope_layers": [3, 1]}, "model.nope_layers"),
        ({"model.nope_layers": [1, 1]}, "model.nope_layers"),
        ({"model.attn_temperature_scale": None}, "model.attn_temperature_floor"),
        ({"model.nope_layers": None}, "model.attn_temperature_floor"),
        ({"model.attn_temperature_floor": 0}, "model.attn_temperature_floor"),
        ({"model.attn_temperature_scale": 0.0}, "model.attn_temperature_scale"),
        (
            {
                "model.rope_scaling": "llama3",
                "model.rope_factor": 8.0,
                "model.rope_original_max_seq_len": 16,
                "model.rope_low_freq_factor": 2.0,
                "model.rope_high_freq_factor": 1.0,
            },
            "model.rope_high_freq_factor",
        ),
    ],
)
def test_rules_are_refused_by_key(extra: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config({**LLAMA4, **extra})


@pytest.mark.parametrize("key", ["model.qk_norm_after_rope", "model.attn_temperature_floor"])
def test_latent_attention_refuses_them_by_key(key: str) -> None:
    """(NoPE layers it has: tests/unit/test_kda.py, Kimi Linear's latent attention.)"""
    mla = {
        "model.attention": "mla",
        "model.n_kv_heads": 4,
        "model.kv_lora_rank": 16,
        "model.qk_nope_head_dim": 8,
        "model.qk_rope_head_dim": 8,
        "model.v_head_dim": 8,
        "model.rope_interleave": False,
    }
    settings = {k: v for k, v in LLAMA4.items() if k == "model.n_layers" or k == key}
    if key == "model.attn_temperature_floor":
        settings |= {"model.nope_layers": [1], "model.attn_temperature_scale": 0.1}
        settings[key] = 3
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config({**mla, **settings})


def test_no_layer_is_nope_by_default() -> None:
    cfg = dataclasses.replace(tiny_config().model)
    assert all(cfg.has_rope(i) for i in range(cfg.n_layers))
    assert cfg.attn_temperature(0) is None
