"""Granite 4.0-H (GraniteMoeHybridForCausalLM; granite-4.0-h-small, -h-tiny, -h-micro): hybrid
layers, Mamba-2 (``model.linear_attention: mamba2``) in the ``mamba`` layers of ``layer_types``
and grouped-query attention in the ``attention`` ones (transformers reads them as
``linear_attention`` / ``full_attention``); attention with RoPE in every attention layer or
in none (``position_embedding_type``: ``rope``, or ``nope`` as released: ``model.nope_layers``
every attention layer). Each layer's FFN is Granite-MoE's (:mod:`.granitemoe`: top-k on the
router logits, then softmax over the k; fused experts) plus its shared MLP of
``shared_intermediate_size`` (moetrain's shared experts, merged), with the muP-style scalars
Granite-MoE has.

Weights: the Mamba-2 layer's ``mamba.{in_proj, conv1d, dt_bias, A_log, D, norm, out_proj}``,
the shared MLP's ``shared_mlp.input_linear`` (2S, D) = [gate; up] and
``shared_mlp.output_linear`` (D, S), the experts' and router's as Granite-MoE's.
"""

from __future__ import annotations

import math
from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.layer_plan import FULL, LINEAR, layer_types
from moetrain.convert.families import granitemoe, hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ANY, only, refused_when

NAME = "GraniteMoeHybridForCausalLM"
# the layer types of its files (transformers' newer names read too) -> moetrain's
TYPES = {"mamba": LINEAR, LINEAR: LINEAR, "attention": FULL, FULL: FULL}
RELEASED_TYPES = {LINEAR: "mamba", FULL: "attention"}


def _attention_layers(model: ModelConfig) -> list[int]:
    return [i for i, t in enumerate(layer_types(model)) if t == FULL]


def _has_mamba(model: ModelConfig) -> bool:
    return LINEAR in layer_types(model)


HOLDS = {
    **granitemoe.HOLDS,
    "model.layer_types": refused_when(
        lambda m, _: any(t not in RELEASED_TYPES for t in layer_types(m)),
        "{name} has Mamba-2 (linear_attention) or full attention in every layer",
    ),
    "model.linear_attention": only(
        "mamba2",
        applies=lambda m, _: _has_mamba(m),
        why="{name} has Mamba-2 in its linear layers; must be mamba2",
    ),
    "model.nope_layers": refused_when(
        lambda m, _: m.nope_layers not in (None, _attention_layers(m)),
        "{name} rotates the queries and keys of every attention layer or of none "
        "(position_embedding_type); must be null or every full_attention layer",
    ),
    "model.mamba_head_dim": refused_when(
        lambda m, _: (
            m.mamba_num_heads is not None and m.mamba_num_heads * m.mamba_head_dim % m.d_model != 0
        ),
        "{name} sizes its Mamba-2 layers as mamba_expand * hidden_size; "
        "model.mamba_num_heads * model.mamba_head_dim must be a multiple of model.d_model",
    ),
    "moe.num_shared_experts": refused_when(
        lambda _, moe: moe.num_shared_experts == 0,
        "{name} always has its shared MLP; moe.num_shared_experts must be at least 1",
    ),
    "moe.shared_expert_hidden": ANY,
}
LAYOUT = granitemoe.SHARED_FAMILY.layout


def mamba_hf(model: ModelConfig) -> dict[str, Any]:
    """The transformers fields of the Mamba-2 layers (one head as wide as the model where
    there are none: transformers checks the sizes even then)."""
    if not _has_mamba(model):
        return dict(mamba_n_heads=1, mamba_d_head=model.d_model, mamba_expand=1)
    inner = model.mamba_num_heads * model.mamba_head_dim
    fields = dict(
        mamba_n_heads=model.mamba_num_heads,
        mamba_d_head=model.mamba_head_dim,
        mamba_n_groups=model.mamba_n_groups,
        mamba_d_state=model.mamba_state_dim,
        mamba_d_conv=model.mamba_conv_kernel,
        mamba_expand=inner // model.d_model,
        mamba_chunk_size=model.mamba_chunk_size,
        mamba_conv_bias=model.mamba_conv_bias,
        mamba_proj_bias=model.mamba_proj_bias,
    )
    if model.mamba_dt_min > 0 or model.mamba_dt_max is not None:
        high = math.inf if model.mamba_dt_max is None else model.mamba_dt_max
        fields["time_step_limit"] = [model.mamba_dt_min, high]
    return fields


def mamba_from_hf(hf: Any, model: ModelConfig, name: str) -> None:
    """Set ``model``'s Mamba-2 keys from ``hf`` (read from ``name``'s config)."""

    def count(key: str) -> int:
        return hf_config.hf_number(hf, key, name, integer=True, positive=True)

    model.linear_attention = "mamba2"
    model.mamba_num_heads, model.mamba_head_dim = count("mamba_n_heads"), count("mamba_d_head")
    model.mamba_n_groups, model.mamba_state_dim = count("mamba_n_groups"), count("mamba_d_state")
    model.mamba_conv_kernel, model.mamba_chunk_size = (
        count("mamba_d_conv"),
        count("mamba_chunk_size"),
    )
    model.mamba_conv_bias = bool(getattr(hf, "mamba_conv_bias", True))
    model.mamba_proj_bias = bool(getattr(hf, "mamba_proj_bias", False))
    limit = tuple(getattr(hf, "time_step_limit", None) or (0.0, math.inf))
    if len(limit) != 2 or not 0 <= limit[0] < limit[1]:
        raise ConfigError(f"time_step_limit: {name} needs (min, max), 0 <= min < max; got {limit}")
    model.mamba_dt_min = float(limit[0])
    model.mamba_dt_max = None if math.isinf(limit[1]) else float(limit[1])


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return dict(
        granitemoe.to_hf(cfg),
        shared_intermediate_size=moe.shared_hidden,
        layer_types=[RELEASED_TYPES[t] for t in layer_types(model)],
        position_embedding_type="nope" if model.nope_layers else "rope",
        **mamba_hf(model),
    )


def from_hf(hf: Any) -> Config:
    model, moe = granitemoe.granite_from_hf(hf, NAME)
    n = model.n_layers
    types = list(getattr(hf, "layer_types", None) or [])
    if len(types) != n or any(t not in TYPES for t in types):
        raise ConfigError(
            f"layer_types: {NAME} needs mamba or attention for each of the {n} layers; got {types}"
        )
    model.layer_types = [TYPES[t] for t in types]
    if LINEAR in model.layer_types:
        mamba_from_hf(hf, model, NAME)
    position = getattr(hf, "position_embedding_type", None)
    if position not in (None, "rope", "nope"):
        raise ConfigError(f"position_embedding_type: {NAME} knows rope and nope; got {position!r}")
    if position != "rope":  # transformers rotates only with "rope"
        model.nope_layers = _attention_layers(model) or None
    if not moe.num_experts:
        raise ConfigError(f"num_local_experts: {NAME} without experts is a dense model; got 0")
    shared = hf_config.hf_number(hf, "shared_intermediate_size", NAME, integer=True, positive=True)
    moe.num_shared_experts, moe.shared_expert_hidden = 1, shared
    return hf_config.finish(model, moe)


FAMILY = Family("granitemoehybrid", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
