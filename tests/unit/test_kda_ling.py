"""Ling 3.0's token mixers. Its Kimi Delta Attention (``model.kda_full_rank_gates``,
``model.kda_gate_lower_bound``): full-rank forget and output gates (``f_proj``, ``g_proj``) and
the bounded forget gate ``b * sigmoid(exp(A_log) * (f + dt_bias))``; the layer against a
written-out token recurrence in fp64 (values and gradients, packed documents), against
transformers' Ling 3.0 layer (``BailingHybridDeltaAttention``) both ways, its saved tensors
against the plan's count, its keys refused by key. Its latent attention with a sigmoid gate per
head (``model.mla_head_gate``) against transformers' ``BailingHybridAttention``."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig
from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
    BailingHybridDeltaAttention,
)

from moetrain.config import ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.model import Transformer
from moetrain.model.delta_rule import gated_delta_rule_recurrent
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.mixers.kda import KimiDeltaAttention
from moetrain.model.short_conv import short_conv
from moetrain.plan import activation_bytes_per_token
from tests.helpers.configs import tiny_config
from tests.helpers.memory import saved_storages
from tests.helpers.recurrent_models import check_plan_saved_tensors, rel
from tests.unit.test_gated_deltanet import randomise, torch_matmul  # noqa: F401 (a fixture)
from tests.unit.test_kda import HYBRID, _inputs

LING = {**HYBRID, "model.kda_full_rank_gates": True, "model.kda_gate_lower_bound": -5.0}


def _our_layer(dtype: torch.dtype = torch.float32) -> KimiDeltaAttention:
    cfg = tiny_config(LING).model
    torch.manual_seed(0)
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
    randomise(ours, 0)
    with torch.no_grad():  # the gate's slope exp(A_log) from ~0.14 to ~4.5
        ours.A_log.copy_(torch.tensor([-2.0, 0.0, 1.0, 1.5]))
        ours.dt_bias.copy_(torch.linspace(-1.0, 2.0, 32))
    return ours.to(dtype)


def _hf_name(name: str) -> str:
    if name.startswith(("f_proj", "dt_bias", "A_log")):
        return f"forget_gate.{name}"
    return name.replace("wo.", "o_proj.")


def _transformers_layer(ours: KimiDeltaAttention) -> BailingHybridDeltaAttention:
    hf = BailingHybridConfig(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        num_hidden_layers=3,
        short_conv_kernel_size=4,
        kda_lower_bound=-5.0,
        rms_norm_eps=tiny_config(LING).model.norm_eps,
    )
    theirs = BailingHybridDeltaAttention(hf, 0)
    state = {_hf_name(k): v for k, v in ours.state_dict().items() if "conv1d" not in k}
    state["conv1d.weight"] = torch.cat([ours.get_parameter(f"{p}_conv1d.weight") for p in "qkv"])
    theirs.load_state_dict({k: v.detach() for k, v in state.items()})
    return theirs


def reference(layer: KimiDeltaAttention, x: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Ling 3.0's layer written out: the bounded gate by its formula, the convolution and the
    rule token by token (each document alone)."""
    b, s, _ = x.shape
    h, k = layer.h, layer.dk
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
    weight = torch.cat([layer.get_parameter(f"{p}_conv1d.weight") for p in "qkv"]).squeeze(1)
    f = (x @ layer.f_proj.weight.T + layer.dt_bias).view(b, s, h, k)
    g = -5.0 * torch.sigmoid(layer.A_log.exp()[:, None] * f)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    out = torch.zeros(b, s, h, k, dtype=x.dtype)
    for r in range(b):
        for doc in docs[r].unique():
            at = (docs[r] == doc).nonzero()[:, 0]
            mixed, _ = short_conv(qkv[r : r + 1, at], weight, activation="silu")
            q, kk, v = (t.view(1, len(at), h, k) for t in mixed.split(h * k, dim=-1))
            o, _ = gated_delta_rule_recurrent(
                q, kk, v, g[r : r + 1, at], beta[r : r + 1, at], qk_l2norm=True
            )
            out[r, at] = o[0]
    gate = (x @ layer.g_proj.weight.T).view(b, s, h, k)
    o32 = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps)
    y = layer.o_norm.weight * o32 * torch.sigmoid(gate)
    return y.reshape(b, s, -1) @ layer.wo.weight.T


def test_layer_equals_the_written_out_recurrence_in_fp64() -> None:
    """fp64, two rows of 150 tokens (three chunks), one packing documents of 70, 1 and 79:
    values and every gradient within 1e-10; the unbounded Kimi gate in the module's place (the
    control) differs."""
    layer = _our_layer(torch.float64)
    x = torch.randn(2, 150, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    docs = torch.stack(
        [torch.cat([torch.zeros(70), torch.ones(1), torch.full((79,), 2)]), torch.zeros(150)]
    ).long()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa, _inputs(150, docs)), reference(layer, xb, docs)
    assert rel(ya, yb) <= 1e-10
    params = list(layer.parameters())
    ga = torch.autograd.grad(ya.square().sum(), [xa, *params])
    gb = torch.autograd.grad(yb.square().sum(), [xb, *params], allow_unused=True)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, ga, gb, strict=True):
        if b is not None:
            assert rel(a, b) <= 1e-10, name
        else:  # (the reference takes the convolutions joined)
            assert "conv1d" in name
    layer.bound = None
    with torch.no_grad():
        assert rel(layer(x, _inputs(150, docs)), yb) > 1e-2


def test_layer_equals_transformers_values_and_gradients_both_ways(torch_matmul) -> None:  # noqa: F811
    """fp32, 80 tokens (two chunks): ours loaded into transformers' Ling 3.0 layer, and
    transformers' (re-drawn) loaded back, give the same values (1e-5 of the largest) and
    gradients (5e-5); a lower bound of -4 instead of -5 fails the values."""
    ours = _our_layer()
    theirs = _transformers_layer(ours)
    x = torch.randn(2, 80, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa, _inputs(80)), theirs(xb)
        assert rel(ya, yb) <= 1e-5
        w = torch.randn_like(ya)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        assert rel(xa.grad, xb.grad) <= 5e-5
        named = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            if "conv1d" not in name:
                assert rel(p.grad, named[_hf_name(name)].grad) <= 5e-5, name
        ours.zero_grad(), theirs.zero_grad()
        with torch.no_grad():  # transformers' weights, re-drawn, into ours
            for name, p in theirs.named_parameters():
                if name.endswith("weight") and "norm" not in name:
                    p.copy_(torch.randn_like(p) * 0.3)
            state = {k: v for k, v in theirs.state_dict().items() if k != "conv1d.weight"}
            ours_state = {n: state[_hf_name(n)] for n in ours.state_dict() if "conv1d" not in n}
            for i, p in enumerate("qkv"):
                ours_state[f"{p}_conv1d.weight"] = theirs.conv1d.weight[i * 32 : (i + 1) * 32]
            ours.load_state_dict(ours_state)
    theirs.forget_gate.lower_bound = -4.0
    with torch.no_grad():
        assert rel(theirs(x), ours(x, _inputs(80))) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_activation_formula_matches_saved_tensors(dtype: torch.dtype) -> None:
    """The hybrid model with Ling 3.0's KDA layers; and the latent attention head gate's bytes:
    a one-layer latent attention model with the gate saves what the plan adds for it more than
    without it (CPU attention pads latent attention's heads, so its whole count is not held to
    1%)."""
    cfg = tiny_config(LING, {"data.seq_len": 128, "model.loss_chunk_tokens": 128})
    check_plan_saved_tensors(cfg, dtype)
    sizes = {"model.n_layers": 1, "model.max_seq_len": 256, "data.seq_len": 128}
    measured, planned = [], []
    for gate in (False, True):
        cfg = tiny_config(MLA_GATED, sizes, {"model.mla_head_gate": gate})
        model = Transformer(cfg.model, cfg.moe).to(dtype)
        ids = torch.randint(0, 64, (4, 128))
        with saved_storages([*model.parameters(), *model.buffers()]) as seen:
            model(ids, labels_BS=ids, return_logits=False)
        measured.append(sum(seen.values()) / ids.numel())
        planned.append(activation_bytes_per_token(cfg, 0, 4 if dtype == torch.float32 else 2))
    assert measured[1] - measured[0] == planned[1] - planned[0] > 0


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.kda_gate_lower_bound": 0.5}, "model.kda_gate_lower_bound"),
        (
            {
                "model.linear_attention": "gated_deltanet",
                "model.linear_num_heads": None,
                "model.linear_head_dim": None,
                "model.linear_num_key_heads": 4,
                "model.linear_num_value_heads": 4,
                "model.linear_key_head_dim": 8,
                "model.linear_value_head_dim": 8,
            },
            "model.kda_full_rank_gates",
        ),
    ],
)
def test_its_keys_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(LING, overrides)


MLA_GATED = {  # Ling 3.0's latent attention: RoPE in adjacent pairs, a gate per head
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 4,
    "model.v_head_dim": 6,
    "model.rope_interleave": True,
    "model.mla_head_gate": True,
}


def test_latent_attention_with_a_head_gate_equals_ling_3s() -> None:
    """Ling 3.0's latent attention (``model.mla_head_gate``: sigmoid(g_proj(x)) per head on its
    output) equals transformers' ``BailingHybridAttention`` both ways (values 1e-5 of the
    largest, gradients 5e-5); without the gate (the control) it does not."""
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
        BailingHybridAttention,
        BailingHybridRotaryEmbedding,
    )

    from moetrain.model.rope import model_rope_tables

    cfg = tiny_config(MLA_GATED).model
    torch.manual_seed(0)
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
    hf = BailingHybridConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-6,
    )
    hf._attn_implementation = "eager"
    theirs = BailingHybridAttention(hf, 0)
    names = {
        "wq": "q_proj",
        "wkv_a": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "wkv_b": "kv_b_proj",
        "wo": "o_proj",
    }

    def theirs_name(n: str) -> str:
        module, _, rest = n.partition(".")
        return f"{names.get(module, module)}.{rest}"

    theirs.load_state_dict({theirs_name(k): v for k, v in ours.state_dict().items()})
    s = 12
    x = torch.randn(2, s, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = BailingHybridRotaryEmbedding(hf)(x, torch.arange(s)[None])
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    our_cos, our_sin = model_rope_tables(cfg, s)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = ours(xa, MixerInputs(our_cos, our_sin))
    yb = theirs(xb, (cos, sin), mask)[0]
    assert rel(ya, yb) <= 1e-5
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    assert rel(xa.grad, xb.grad) <= 5e-5
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, named[theirs_name(name)].grad) <= 5e-5, name
    gate, ours.g_proj = ours.g_proj, None
    with torch.no_grad():
        assert rel(ours(x, MixerInputs(our_cos, our_sin)), yb) > 1e-2
    ours.g_proj = gate


@pytest.mark.parametrize(
    ("fmt", "changes", "key"),
    [
        ("kimi_linear", {"model.kda_full_rank_gates": True}, "model.kda_full_rank_gates"),
        ("kimi_linear", {"model.kda_gate_lower_bound": -5.0}, "model.kda_gate_lower_bound"),
        ("kimi_linear", {"model.mla_head_gate": True}, "model.mla_head_gate"),
        ("deepseek_v3", {"model.mla_head_gate": True}, "model.mla_head_gate"),
    ],
)
def test_the_families_that_cannot_hold_them_refuse_them_by_key(fmt, changes, key) -> None:
    from moetrain.convert.formats import choose_format
    from tests.helpers.convert_models import tiny_cfg

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(tiny_cfg(fmt, changes), fmt)
