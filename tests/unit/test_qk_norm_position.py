"""The learned per-head query/key norm after RoPE (``model.qk_norm_position: after_rope``,
Hunyuan-A13B's): against attention written out (project, rotate half-split heads, RMSNorm
each rotated head with its weight, causal softmax), values and gradients; it changes the
output from the norm before RoPE; and the rule that it needs a per-head norm, refused by key."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.model.mixers import MixerInputs
from moetrain.model.mixers.gqa import Attention
from moetrain.model.rope import rope_tables
from tests.helpers.configs import tiny_config

AFTER = {"model.qk_norm": True, "model.qk_norm_position": "after_rope", "model.rope_theta": 50.0}


def _attention(**extra) -> Attention:
    cfg = tiny_config({**AFTER, **extra}).model
    torch.manual_seed(0)
    attn = Attention(cfg, mixer_spec(cfg, 0)).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.4)
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    return attn


def reference(attn: Attention, x: torch.Tensor, theta: float, eps: float) -> torch.Tensor:
    b, s, _ = x.shape
    h, g, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, s, h, hd)
    k = (x @ attn.wk.weight.T).view(b, s, g, hd)
    v = (x @ attn.wv.weight.T).view(b, s, g, hd)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = (torch.arange(s, dtype=torch.float32)[:, None] * inv).double()
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

    def rotate(t):
        a, c = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat((a * cos - c * sin, c * cos + a * sin), -1)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    q, k = rms(rotate(q), attn.q_norm.weight), rms(rotate(k), attn.k_norm.weight)
    k, v = (t.repeat_interleave(h // g, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * hd)
    return out @ attn.wo.weight.T


def _inputs(cfg, s: int) -> MixerInputs:
    cos, sin = rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
    return MixerInputs(cos=cos[:s].double(), sin=sin[:s].double())


def test_after_rope_matches_the_written_out_attention_values_and_gradients() -> None:
    cfg = tiny_config(AFTER).model
    attn = _attention()
    x = torch.randn(2, 11, cfg.d_model, dtype=torch.float64, requires_grad=True)
    got = attn(x, _inputs(cfg, 11))
    ref = reference(attn, x, cfg.rope_theta, cfg.norm_eps)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # (the norms run in fp32)
    g = torch.randn_like(got)
    (dx,) = torch.autograd.grad(got, x, g)
    (rx,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-6)
    # the norm before RoPE (the same weights) computes another function
    before = _attention(**{"model.qk_norm_position": "before_rope"})
    before.load_state_dict(attn.state_dict())
    assert (before(x, _inputs(cfg, 11)) - got).abs().max() > 1e-3


@pytest.mark.parametrize("extra", [{"model.qk_norm": False}, {"model.qk_norm_scope": "projection"}])
def test_after_rope_needs_a_per_head_norm(extra) -> None:
    with pytest.raises(ConfigError, match=r"model\.qk_norm_position"):
        tiny_config({**AFTER, **extra})
