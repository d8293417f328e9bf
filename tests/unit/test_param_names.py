"""moetrain.model.param_names spells exactly the Transformer's state-dict keys."""

from __future__ import annotations

import torch

from moetrain.model import Transformer, param_names
from tests.helpers.configs import tiny_config


def spelled(cfg) -> set[str]:
    """Every key of ``cfg``'s model, from param_names alone."""
    m, moe = cfg.model, cfg.moe
    out = {param_names.EMBED, param_names.FINAL_NORM, param_names.LM_HEAD}
    if m.norm == "layernorm":
        out.add(param_names.FINAL_NORM_BIAS)
    if m.lm_head_bias:
        out.add(param_names.LM_HEAD_BIAS)
    for i in range(m.n_layers):
        out |= {param_names.attn_norm(i), param_names.ffn_norm(i)}
        if m.norm == "layernorm":
            out |= {param_names.attn_norm(i, "bias"), param_names.ffn_norm(i, "bias")}
        out |= {param_names.attn(i, p) for p in param_names.ATTN_PROJECTIONS}
        if m.qkv_bias:
            out |= {param_names.attn(i, p, "bias") for p in ("wq", "wk", "wv")}
        if m.o_bias:
            out.add(param_names.attn(i, "wo", "bias"))
        if m.qk_norm:
            out |= {param_names.qk_norm(i, "q"), param_names.qk_norm(i, "k")}
        if not moe.is_moe_layer(i):
            out |= {param_names.dense_ffn(i, w) for w in param_names.SWIGLU_WEIGHTS}
            continue
        out |= {param_names.router_gate(i), param_names.expert_bias(i)}
        out |= {param_names.experts(i, "w13"), param_names.experts(i, "w2")}
        if moe.num_shared_experts:
            out |= {param_names.shared_expert(i, w) for w in param_names.SWIGLU_WEIGHTS}
        if moe.shared_expert_gate:
            out.add(param_names.shared_gate(i))
    return out


def test_names_are_the_models_state_dict_keys() -> None:
    for extra in (
        {},
        {
            "model.qkv_bias": True,
            "model.qk_norm": True,
            "moe.first_k_dense": 1,
            "moe.num_shared_experts": 1,
            "moe.shared_expert_gate": True,
        },
        {"model.norm": "layernorm", "model.o_bias": True, "model.lm_head_bias": True},
        {"model.lm_head_bias": True, "model.tie_embeddings": True},
    ):
        cfg = tiny_config({"model.n_layers": 3}, extra)
        with torch.device("meta"):
            keys = set(Transformer(cfg.model, cfg.moe).state_dict())
        assert spelled(cfg) == keys, extra


def test_parse_experts_and_expert_bias() -> None:
    assert param_names.parse_experts(param_names.experts(7, "w13")) == (7, "w13")
    assert param_names.parse_experts(param_names.router_gate(7)) is None
    assert param_names.parse_experts("layers.7.ffn.experts.w13.extra") is None
    assert param_names.is_expert_bias(param_names.expert_bias(3))
    assert not param_names.is_expert_bias(param_names.router_gate(3))
