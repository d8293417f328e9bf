"""Trinity (AfmoeForCausalLM; Arcee's Trinity-Nano, -Mini, -Large): sliding-window and full
attention layers (``layer_types``; released three sliding to one global), RoPE on the sliding
layers only (the full ones NoPE: ``model.nope_layers``), per-head query/key RMSNorm before RoPE
(``model.qk_norm``), a sigmoid output gate per head (``model.attention_output_gate``, the gate
Qwen3-Next computes, held by the files as ``self_attn.gate_proj``), sandwich norms
(``model.block_norms: sandwich``: ``input_layernorm`` / ``post_attention_layernorm`` around the
attention, ``pre_mlp_layernorm`` / ``post_mlp_layernorm`` around the FFN), muP's input scaling
(``mup_enabled``: the embeddings times sqrt(hidden_size), ``model.embedding_multiplier``), the
first ``num_dense_layers`` layers dense, then a sigmoid router (``mlp.router.gate``) choosing on
the scores shifted by the selection bias ``mlp.expert_bias`` (moetrain's aux-loss-free
``expert_bias``), weights from the unbiased scores, always renormalised, times ``route_scale``,
and ungated shared experts of ``num_shared_experts`` x ``moe_intermediate_size``."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.layer_plan import FULL, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import (
    ANY,
    SHARED_EXPERTS_ALWAYS,
    SHARED_SIZED_BY_COUNT,
    free,
    only,
    refused_when,
)
from moetrain.convert.families.layout import Layout

NAME = "AfmoeForCausalLM"


def _full_layers(model: ModelConfig) -> list[int]:
    return [i for i, t in enumerate(layer_types(model)) if t == FULL]


def _mup_scale(model: ModelConfig) -> float:
    """muP's input scaling: sqrt(hidden_size), as transformers computes it."""
    return model.d_model**0.5


HOLDS = {
    **free("model.sliding_window", "moe.first_k_dense", "moe.route_scale"),
    "model.nope_layers": refused_when(
        lambda m, _: (m.nope_layers or []) != _full_layers(m),
        "{name} rotates the sliding-window layers' queries and keys only: must list exactly "
        "the full-attention layers",
    ),
    "model.embedding_multiplier": refused_when(
        lambda m, _: m.embedding_multiplier not in (1.0, _mup_scale(m)),
        "{name} scales the embeddings by sqrt(d_model) (mup_enabled) or not at all; must be "
        "1.0 or model.d_model ** 0.5",
    ),
    "model.block_norms": only("sandwich"),
    "model.attention_output_gate": only(True),
    "model.qk_norm": only(True),
    "moe.score_func": only("sigmoid"),
    "moe.renormalize": only(True),
    "moe.bias_update_rate": ANY,
    "moe.num_shared_experts": SHARED_EXPERTS_ALWAYS,
    "moe.shared_expert_hidden": SHARED_SIZED_BY_COUNT,
}
LAYOUT = Layout(
    router="router.gate",
    selection_bias="expert_bias",
    shared_expert="shared_experts",
    sandwich_norms=("post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"),
    attention_gate="self_attn.gate_proj",
)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return dict(
        hf_config.hf_common(cfg),
        intermediate_size=model.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        num_experts=moe.num_experts,
        num_shared_experts=moe.num_shared_experts,
        num_dense_layers=moe.first_k_dense,
        route_scale=moe.route_scale,
        layer_types=hf_config.layer_types(model),
        sliding_window=model.sliding_window,
        mup_enabled=model.embedding_multiplier != 1.0,
        attention_bias=False,
        hidden_act="silu",
        # as released: the routing keys other readers take (transformers' class routes so)
        score_func="sigmoid",
        route_norm=True,
        n_group=1,
        topk_group=1,
    )


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_dropout(hf)
    hf_config.refuse_attention_bias(hf)
    for key, computed in (("score_func", "sigmoid"), ("route_norm", True)):
        if get(key, computed) != computed:
            raise ConfigError(
                f"{key}: {NAME}'s class routes with {key} {computed}; got {get(key, None)}"
            )
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    hf_config.refuse_partial_rotary(model, NAME)
    hf_config.windows_from_hf(hf, model)
    model.nope_layers = _full_layers(model) or None
    model.qk_norm, model.attention_output_gate, model.block_norms = True, True, "sandwich"
    if get("mup_enabled", False):
        model.embedding_multiplier = _mup_scale(model)
    moe.num_experts, moe.expert_hidden = hf.num_experts, hf.moe_intermediate_size
    moe.score_func, moe.renormalize = "sigmoid", True
    moe.route_scale = float(hf_config.hf_number(hf, "route_scale", NAME, 1.0, positive=True))
    # (its class always holds shared experts: none would be tensors of size 0)
    moe.num_shared_experts = hf_config.hf_number(
        hf, "num_shared_experts", NAME, integer=True, positive=True
    )
    moe.first_k_dense = min(int(get("num_dense_layers", 0) or 0), model.n_layers)
    return hf_config.finish(model, moe)


FAMILY = Family("afmoe", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
