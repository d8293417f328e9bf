"""DeepSeek-V4's clamped SwiGLU, ``silu(min(a, l)) * clamp(b, -l, l)``: moetrain's clamped SwiGLU
with ``moe.swiglu_alpha: 1``, ``moe.swiglu_up_offset: 0``, for the experts and (through
``model.ffn_activation: clamped_swiglu``) the shared experts, against transformers' modules
where the clamps bind (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.clamped_swiglu import clamped_swiglu_packed
from moetrain.model.layers import SwiGLU
from moetrain.model.transformer import Transformer
from tests.helpers.configs import tiny_config

LIMIT = 0.7
V4 = {
    "moe.activation": "clamped_swiglu",
    "moe.swiglu_alpha": 1.0,
    "moe.swiglu_limit": LIMIT,
    "moe.swiglu_up_offset": 0.0,
}


def written_out(h: torch.Tensor) -> torch.Tensor:
    a, b = h.chunk(2, -1)
    return torch.nn.functional.silu(a.clamp(max=LIMIT)) * b.clamp(-LIMIT, LIMIT)


def test_offset_zero_is_deepseek_v4s_rule_values_and_gradients() -> None:
    torch.manual_seed(0)
    h = (torch.randn(6, 16, dtype=torch.float64) * 2).requires_grad_(True)  # clamps bind
    w = torch.rand(6, dtype=torch.float64, requires_grad=True)
    got = clamped_swiglu_packed(h, w, 1.0, LIMIT, 0.0)
    ref_h = h.detach().clone().requires_grad_(True)
    ref_w = w.detach().clone().requires_grad_(True)
    want = written_out(ref_h) * ref_w[:, None]
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    torch.autograd.backward(got, g)
    torch.autograd.backward(want, g)
    torch.testing.assert_close(h.grad, ref_h.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)
    # negative control: gpt-oss's offset 1 is another function
    assert not torch.allclose(clamped_swiglu_packed(h, w, 1.0, LIMIT, 1.0), want)


def test_matches_transformers_experts_and_shared_mlp() -> None:
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    hf_cfg = DeepseekV4Config(
        hidden_size=8, moe_intermediate_size=4, n_routed_experts=2, swiglu_limit=LIMIT,
        num_hidden_layers=1,
    )  # fmt: skip
    torch.manual_seed(1)
    h = torch.randn(5, 8) * 2
    experts = v4.DeepseekV4Experts(hf_cfg)
    torch.testing.assert_close(
        clamped_swiglu_packed(h, None, 1.0, LIMIT, 0.0), experts._apply_gate(h)
    )
    mlp, ours = v4.DeepseekV4MLP(hf_cfg), SwiGLU(8, 4, "clamped_swiglu", (1.0, LIMIT, 0.0))
    with torch.no_grad():
        for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            getattr(ours, a).weight.copy_(torch.randn_like(getattr(mlp, b).weight))
            getattr(mlp, b).weight.copy_(getattr(ours, a).weight)
    x = torch.randn(5, 8) * 3
    torch.testing.assert_close(ours(x), mlp(x))


def test_shared_and_dense_mlps_clamp_in_the_model() -> None:
    cfg = tiny_config(
        V4, model__ffn_activation="clamped_swiglu", moe__num_shared_experts=1, moe__first_k_dense=1
    )
    model = Transformer(cfg.model, cfg.moe)
    assert model.layers[0].ffn.clamp == (1.0, LIMIT, 0.0)
    assert model.layers[1].ffn.shared_expert.clamp == (1.0, LIMIT, 0.0)
    assert model.layers[1].ffn.experts.act_fn.keywords["offset"] == 0.0


def test_refusals() -> None:
    with pytest.raises(ConfigError, match=r"moe\.swiglu_up_offset"):
        tiny_config(moe__swiglu_up_offset=0.0)
    with pytest.raises(ConfigError, match=r"model\.ffn_activation"):
        tiny_config(model__ffn_activation="clamped_swiglu")
