"""Granite-MoE (GraniteMoeForCausalLM; granite-3.0-1b-a400m, granite-3.1-3b-a800m): top-k on
the router logits, then softmax over the k (``moe.topk_before_score``), no shared experts, MoE
in every layer, biases on all four attention projections or none (``attention_bias``:
``model.qkv_bias`` and ``model.o_bias``), and muP-style scalars: the embeddings times
``embedding_multiplier``, each block's attention and MoE outputs times ``residual_multiplier``,
attention's softmax scale ``attention_multiplier`` (moetrain's ``model.attention_scale``), the
logits divided by ``logits_scaling`` (``model.embedding_multiplier``,
``model.residual_multiplier``, ``model.logits_scaling``). Its files hold each layer's experts
fused: ``block_sparse_moe.input_linear.weight`` (E, 2F, D) = [gate; up],
``block_sparse_moe.output_linear.weight`` (E, D, F) and the router
``block_sparse_moe.router.layer.weight`` (transformers v5 renames them in memory to
``block_sparse_moe.experts.gate_up_proj`` / ``down_proj`` and ``block_sparse_moe.router``).

Granite-MoE-Shared (GraniteMoeSharedForCausalLM) is the same model with one ungated shared
expert of ``shared_intermediate_size`` added to the MoE output (moetrain's shared experts,
merged: ``moe.shared_hidden``), stored beside the MoE block as ``shared_mlp.input_linear``
(2S, D) = [gate; up] and ``shared_mlp.output_linear`` (D, S)."""

from __future__ import annotations

import dataclasses
from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import base, hf_config
from moetrain.convert.families.base import Family, WeightNames

NAME = "GraniteMoeForCausalLM"
SHARED_NAME = "GraniteMoeSharedForCausalLM"


def problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    return base.found(_checks(model, moe, NAME) + [base.no_shared_experts(moe, NAME)])


def shared_problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    gate = (moe.shared_expert_gate, "moe.shared_expert_gate", f"{SHARED_NAME} does not gate it")
    return base.found(_checks(model, moe, SHARED_NAME) + [gate])


def _checks(model: ModelConfig, moe: MoEConfig, name: str) -> list[base.Check]:
    """What both Granite classes compute (all but the shared expert)."""
    return [
        base.dropless(moe, name),
        base.all_or_no_attention_biases(model, name),
        base.no_qk_norm(model, name),
        (moe.score_func != "softmax", "moe.score_func", f"{name} routes with softmax"),
        (
            not moe.topk_before_score,
            "moe.topk_before_score",
            f"{name} takes top-k on the router logits, then softmax over the k; must be true",
        ),
        (moe.route_scale != 1.0, "moe.route_scale", f"{name} has no route scale; must be 1.0"),
        (
            moe.bias_update_rate != 0.0,
            "moe.bias_update_rate",
            f"{name} has no expert bias (aux-loss-free balancing); must be 0",
        ),
        (moe.n_group != 1, "moe.n_group", f"{name} routes without expert groups; must be 1"),
    ] + base.every_layer_moe(moe, name)


def attention_multiplier(model: ModelConfig) -> float:
    """transformers' ``attention_multiplier`` of ``model``: its attention scale, or
    1 / sqrt(head_dim) where it has none."""
    scale = model.attention_scale
    return model.attention_head_dim**-0.5 if scale is None else scale


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return dict(
        hf_config.hf_common(cfg),
        intermediate_size=moe.expert_hidden,
        num_local_experts=moe.num_experts,
        embedding_multiplier=model.embedding_multiplier,
        residual_multiplier=model.residual_multiplier,
        attention_multiplier=attention_multiplier(model),
        logits_scaling=model.logits_scaling,
        attention_bias=model.qkv_bias,
        hidden_act="silu",
    )


def shared_to_hf(cfg: Config) -> dict[str, Any]:
    moe = cfg.moe
    return dict(
        to_hf(cfg), shared_intermediate_size=moe.shared_hidden if moe.num_shared_experts else 0
    )


def _positive(hf: Any, key: str) -> float:
    return float(hf_config.hf_number(hf, key, NAME, 1.0, positive=True))


def from_hf(hf: Any) -> Config:
    if getattr(hf, "shared_intermediate_size", 0):
        raise ConfigError(
            f"shared_intermediate_size: a shared expert is {SHARED_NAME}'s; {NAME} has none"
        )
    return _from_hf(hf)


def shared_from_hf(hf: Any) -> Config:
    shared = hf_config.hf_number(hf, "shared_intermediate_size", SHARED_NAME, 0, integer=True)
    cfg = _from_hf(hf)
    if shared:
        cfg.moe.num_shared_experts, cfg.moe.shared_expert_hidden = 1, shared
    cfg.validate()
    return cfg


def _from_hf(hf: Any) -> Config:
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    model.qkv_bias = model.o_bias = bool(getattr(hf, "attention_bias", False))
    hf_config.refuse_partial_rotary(model, NAME)
    model.embedding_multiplier = _positive(hf, "embedding_multiplier")
    model.residual_multiplier = _positive(hf, "residual_multiplier")
    model.attention_scale = _positive(hf, "attention_multiplier")
    model.logits_scaling = _positive(hf, "logits_scaling")
    moe.num_experts, moe.expert_hidden = hf.num_local_experts, hf.intermediate_size
    moe.score_func, moe.topk_before_score = "softmax", True
    return hf_config.finish(model, moe)


NAMES = WeightNames(
    moe_block="block_sparse_moe",
    router="router.layer",
    v5_block="block_sparse_moe",
    v5_router="router",
    fused_experts=("input_linear", "output_linear"),
)

FAMILY = Family(
    name="granitemoe",
    architecture=NAME,
    from_hf=from_hf,
    problems=problems,
    to_hf=to_hf,
    names=NAMES,
    multipliers=True,
    o_bias=True,
)

SHARED_FAMILY = Family(
    name="granitemoeshared",
    architecture=SHARED_NAME,
    from_hf=shared_from_hf,
    problems=shared_problems,
    to_hf=shared_to_hf,
    names=dataclasses.replace(
        NAMES, shared_fused=("shared_mlp.input_linear", "shared_mlp.output_linear")
    ),
    multipliers=True,
    o_bias=True,
)
