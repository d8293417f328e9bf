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
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ANY, ATTENTION_BIAS, free, only
from moetrain.convert.families.layout import Fused, Layout

NAME = "GraniteMoeForCausalLM"
SHARED_NAME = "GraniteMoeSharedForCausalLM"
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_scale")
HOLDS = {
    **ATTENTION_BIAS,
    **free(*(f"model.{key}" for key in MULTIPLIERS)),
    "moe.topk_before_score": only(True),
}
LAYOUT = Layout(
    moe_block="block_sparse_moe",
    router="router.layer",
    experts=Fused("input_linear.weight", "output_linear.weight"),
    in_memory={"router.layer": "router"},
)


def attention_multiplier(model: ModelConfig) -> float:
    """transformers' ``attention_multiplier`` of ``model``: its attention scale, or
    1 / sqrt(head_dim) where it has none."""
    scale = model.attention_scale
    return model.attention_head_dim**-0.5 if scale is None else scale


def to_hf(cfg: Config) -> dict[str, Any]:
    """The transformers fields of Granite-MoE, which every Granite MoE class shares: the common
    ones, the experts, the muP-style scalars and the attention biases."""
    model = cfg.model
    return hf_config.local_experts_hf(
        cfg,
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
    return hf_config.finish(*granite_from_hf(hf, NAME))


def granite_from_hf(hf: Any, name: str) -> tuple[ModelConfig, MoEConfig]:
    """The model and MoE sections of any Granite MoE class's config ``hf`` (read from
    ``name``'s): the shape, the attention biases, the muP-style scalars, the experts and their
    routing (top-k on the logits, then softmax over the k)."""
    model, moe = hf_config.local_experts_from_hf(hf)
    model.qkv_bias = model.o_bias = bool(getattr(hf, "attention_bias", False))
    hf_config.refuse_partial_rotary(model, name)

    def positive(key: str) -> float:
        return float(hf_config.hf_number(hf, key, name, 1.0, positive=True))

    model.embedding_multiplier = positive("embedding_multiplier")
    model.residual_multiplier = positive("residual_multiplier")
    model.attention_scale = positive("attention_multiplier")
    model.logits_scaling = positive("logits_scaling")
    moe.score_func, moe.topk_before_score = "softmax", True
    return model, moe


FAMILY = Family("granitemoe", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
SHARED_FAMILY = Family(
    "granitemoeshared",
    SHARED_NAME,
    shared_from_hf,
    shared_to_hf,
    holds={**HOLDS, "moe.num_shared_experts": ANY},  # one ungated shared expert, any size
    layout=dataclasses.replace(
        LAYOUT, shared_fused=("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight")
    ),
)
