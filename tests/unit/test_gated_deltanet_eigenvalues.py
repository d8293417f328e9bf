"""Gated DeltaNet with negative eigenvalues (``model.linear_allow_neg_eigval``: beta = 2
sigmoid(b) in (0, 2), Olmo-Hybrid's): the layer against transformers' Olmo-Hybrid layer (values
and gradients, over several chunks with strong decays), its recurrent state against a full
recomputation, and the key refused where no layer is Gated DeltaNet or the family cannot hold
it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig
from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

from moetrain.config import ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.convert.formats import choose_format
from moetrain.model.mixers import build_mixer
from moetrain.model.mixers.gated_deltanet import GatedDeltaNet
from tests.helpers.configs import tiny_config
from tests.unit.test_gated_deltanet import (  # (torch_matmul: the fixture)
    HYBRID,
    _inputs,
    _rel,
    torch_matmul,  # noqa: F401
)
from tests.unit.test_gated_deltanet import _layer_pair as qwen_layer_pair

# (Olmo-Hybrid's output norm has eps 1e-5 whatever rms_norm_eps says)
NEGATIVE = {**HYBRID, "model.linear_allow_neg_eigval": True, "model.norm_eps": 1e-5}


# the mixer's names -> Olmo-Hybrid's (in_proj_qkv: its q_proj, k_proj, v_proj apart)
OLMO_NAMES = {
    "in_proj_z.weight": "g_proj.weight",
    "in_proj_b.weight": "b_proj.weight",
    "in_proj_a.weight": "a_proj.weight",
    "norm.weight": "o_norm.weight",
    "wo.weight": "o_proj.weight",
}


def _olmo_names(ours: GatedDeltaNet) -> dict[str, torch.Tensor]:
    """The mixer's tensors under Olmo-Hybrid's names."""
    out = {}
    for name, t in ours.state_dict().items():
        if name == "in_proj_qkv.weight":
            keys = ours.hk * ours.dk
            q, k, v = t.split([keys, keys, ours.hv * ours.dv])
            out.update({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v})
        else:
            out[OLMO_NAMES.get(name, name)] = t
    return out


def _layer_pair(neg: bool = True) -> tuple[GatedDeltaNet, OlmoHybridGatedDeltaNet]:
    """Qwen3.5's test layer's weights (strong and weak decays) in a layer with the option."""
    cfg = tiny_config(NEGATIVE, {"model.linear_allow_neg_eigval": neg}).model
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    ours.load_state_dict(qwen_layer_pair()[0].state_dict())
    hf = OlmoHybridConfig(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        linear_allow_neg_eigval=True,
    )
    theirs = OlmoHybridGatedDeltaNet(hf, 0)
    theirs.load_state_dict(_olmo_names(ours))
    return ours, theirs


@pytest.mark.usefixtures("torch_matmul")
def test_layer_equals_olmo_hybrids_values_and_gradients() -> None:
    """200 tokens (four chunks), beta up to 2: values within 1e-5 of the largest, gradients
    within 5e-5 (the tolerances of Qwen3.5's layer); beta in (0, 1) instead fails them."""
    ours, theirs = _layer_pair()
    x = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert ours.in_proj_b(x).sigmoid().max() > 0.75  # writes with beta > 1.5 occur
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, _inputs(200)), theirs(xb)
    assert _rel(ya, yb) <= 1e-5
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    assert _rel(xa.grad, xb.grad) <= 5e-5
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if name != "in_proj_qkv.weight":
            assert _rel(p.grad, named[OLMO_NAMES.get(name, name)].grad) <= 5e-5, name
    plain, _ = _layer_pair(neg=False)  # control: the same weights with beta in (0, 1)
    with torch.no_grad():
        assert _rel(plain(x, _inputs(200)), yb) > 1e-2


def test_the_recurrent_state_continues_as_a_full_recomputation() -> None:
    """A prefill of 60 tokens, 10 more through the state, then one at a time: the full 75
    tokens' output (the token recurrence and the chunked form agree with beta up to 2)."""
    ours, _ = _layer_pair()
    x = torch.randn(1, 75, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = ours(x, _inputs(75))
        state = ours.new_state(1, 75, torch.float32, torch.device("cpu"))
        parts = [ours(x[:, :60], _inputs(60), state), ours(x[:, 60:70], _inputs(10), state)]
        parts += [ours(x[:, t : t + 1], _inputs(1), state) for t in range(70, 75)]
    assert _rel(torch.cat(parts, dim=1), full) <= 1e-5


def test_the_key_is_refused_where_nothing_holds_it() -> None:
    with pytest.raises(ConfigError, match=r"model\.linear_allow_neg_eigval"):
        tiny_config({"model.linear_allow_neg_eigval": True})  # (no Gated DeltaNet layer)
    cfg = tiny_config(NEGATIVE, {"model.attention_output_gate": True, "model.qk_norm": True})
    with pytest.raises(ConfigError, match=r"model\.linear_allow_neg_eigval"):
        choose_format(cfg, "qwen3_next")
    with pytest.raises(ConfigError, match=r"model\.linear_norm_eps"):
        tiny_config({"model.linear_norm_eps": 1e-5})  # (no Gated DeltaNet layer)
    with pytest.raises(ConfigError, match=r"model\.linear_norm_eps"):
        tiny_config(HYBRID, {"model.linear_norm_eps": 0.0})
    cfg = tiny_config(
        HYBRID,
        {"model.linear_norm_eps": 1e-5, "model.attention_output_gate": True},
        {"model.qk_norm": True, "model.zero_centered_norm": True},
    )
    with pytest.raises(ConfigError, match=r"model\.linear_norm_eps"):
        choose_format(cfg, "qwen3_next")
