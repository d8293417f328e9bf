"""Llama 4's text model (Llama4ForCausalLM, ``model_type`` llama4_text; the language model of
Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E).

Attention: grouped-query, rotary embeddings on adjacent pairs (transformers multiplies complex
pairs: ``model.rope_interleave``), plain or scaled (llama3 in the releases), skipped on the NoPE
layers (``no_rope_layers`` zeros: ``model.nope_layers``); a weightless RMSNorm over each query
and key head after RoPE on the RoPE layers (``use_qk_norm``: ``model.qk_norm_after_rope``);
the NoPE layers' queries scaled by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``
(``attn_temperature_tuning``: ``model.attn_temperature_floor`` / ``attn_temperature_scale``);
chunked local attention on the ``chunked_attention`` layers of ``layer_types``
(``attention_chunk_size``: ``model.attention_chunk_size``); biases on all four projections or
none (``attention_bias``: ``model.qkv_bias`` with ``model.o_bias``).

MoE: top-k on the router logits, each chosen expert's weight the sigmoid of its logit
(``moe.score_func: sigmoid``, ``moe.topk_before_score``, no renormalisation), applied to the
expert's input (``moe.score_on_input``), one ungated shared expert of the experts' size
(``intermediate_size``) added; MoE in the layers of ``moe_layers`` (by default every
``interleave_moe_layer_step``-th: ``moe.first_k_dense`` / ``moe.moe_every`` where they give the
same layers), the others dense of ``intermediate_size_mlp`` (``model.dense_hidden``).

Weights: the router ``feed_forward.router.weight``, the experts stacked as moetrain holds them
(``feed_forward.experts.gate_up_proj`` (E, D, 2F) = [gate | up], ``down_proj`` (E, F, D);
transformers keeps these names in memory), ``feed_forward.shared_expert.{gate,up,down}_proj``
and a dense layer's ``feed_forward.{gate,up,down}_proj``.

The released checkpoints are ``Llama4ForConditionalGeneration`` directories (``text_config``,
the text model's tensors under ``language_model.``, a vision tower beside it): importing one
takes the text model and says that the vision tower is not taken (:data:`FAMILY`'s wrapper).
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.model import CHUNKED, FULL
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import (
    ATTENTION_BIAS,
    SHARED_EXPERTS_ALWAYS,
    free,
    only,
    refused_when,
)
from moetrain.convert.families.layout import Layout, Stacked, Wrapper

NAME = "Llama4ForCausalLM"
# transformers' Llama4TextConfig defaults, written where moetrain's model has no temperature
FLOOR_SCALE, ATTN_SCALE = 8192, 0.1
_PLACEMENT = "moe_layers/interleave_moe_layer_step"
HOLDS = {
    "model.rope_interleave": only(True),
    **ATTENTION_BIAS,
    **free(
        "model.nope_layers",
        "model.attn_temperature_floor",
        "model.attention_chunk_size",
        "model.qk_norm_after_rope",
        "moe.first_k_dense",
        "moe.moe_every",
    ),
    "moe.score_func": only(
        "sigmoid", why="{name} weights an expert by the sigmoid of its logit; must be sigmoid"
    ),
    "moe.topk_before_score": only(True),
    "moe.renormalize": only(False),
    "moe.score_on_input": only(True),
    "moe.num_shared_experts": SHARED_EXPERTS_ALWAYS,
    "moe.shared_expert_hidden": refused_when(
        lambda _, moe: moe.num_shared_experts > 0 and moe.shared_hidden != moe.expert_hidden,
        "{name}'s shared expert is as large as an expert (intermediate_size); must equal "
        "moe.expert_hidden={moe.expert_hidden}",
    ),
}
LAYOUT = Layout(
    moe_block="feed_forward",
    router="router",
    experts=Stacked(),
    dense_block="feed_forward",
)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    n, nope = model.n_layers, set(model.nope_layers or ())
    tuned = model.attn_temperature_floor is not None
    fields = hf_config.local_experts_hf(
        cfg,
        intermediate_size_mlp=model.dense_hidden,
        moe_layers=moe.moe_layers(n),
        no_rope_layers=[int(i not in nope) for i in range(n)],
        attention_chunk_size=model.attention_chunk_size,
        layer_types=[CHUNKED if model.attention_chunk(i) else FULL for i in range(n)],
        use_qk_norm=model.qk_norm_after_rope,
        attn_temperature_tuning=tuned,
        floor_scale=model.attn_temperature_floor if tuned else FLOOR_SCALE,
        attn_scale=model.attn_temperature_scale if tuned else ATTN_SCALE,
        attention_bias=model.qkv_bias,
        hidden_act="silu",
    )
    if moe.first_k_dense == 0:  # (moe_layers decides; the step says the same)
        fields["interleave_moe_layer_step"] = moe.moe_every
    return fields


def _nope_layers(hf: Any, n: int) -> list[int]:
    """The NoPE layers of ``no_rope_layers`` (1 = RoPE, 0 = none; transformers fills it)."""
    flags = list(getattr(hf, "no_rope_layers", None) or [1] * n)
    if len(flags) < n or any(f not in (0, 1) for f in flags[:n]):
        raise ConfigError(
            f"no_rope_layers: {NAME} needs a 0 (NoPE) or 1 (RoPE) for each of the {n} layers; "
            f"got {flags}"
        )
    return [i for i in range(n) if not flags[i]]


def _attention(hf: Any, model: ModelConfig) -> None:
    """The layers' attention kinds, chunk size, NoPE layers, norm and temperature."""
    n = model.n_layers
    types = list(getattr(hf, "layer_types", None) or [FULL] * n)
    unknown = sorted(set(types) - {FULL, CHUNKED})
    if len(types) != n or unknown:
        raise ConfigError(
            f"layer_types: moetrain computes {FULL} and {CHUNKED} for each of the {n} layers; "
            f"got {types}"
        )
    if CHUNKED in types:
        chunk = hf_config.hf_number(hf, "attention_chunk_size", NAME, integer=True, positive=True)
        if chunk < model.max_seq_len:  # (a chunk as long as the context: full attention)
            model.attention_chunk_size, model.layer_types = chunk, types
    nope = _nope_layers(hf, n)
    model.nope_layers = nope or None
    model.qk_norm_after_rope = bool(getattr(hf, "use_qk_norm", False))
    if not (getattr(hf, "attn_temperature_tuning", False) and nope):
        return
    floor = hf_config.hf_number(hf, "floor_scale", NAME, integer=True, positive=True)
    scale = hf_config.hf_number(hf, "attn_scale", NAME)
    if scale > 0:  # (0: every multiplier is 1)
        model.attn_temperature_floor, model.attn_temperature_scale = floor, float(scale)


def _placement(hf: Any, n: int) -> tuple[int, int]:
    """``(moe.first_k_dense, moe.moe_every)`` of ``moe_layers`` (transformers derives it from
    ``interleave_moe_layer_step`` when unset)."""
    layers = getattr(hf, "moe_layers", None)
    ok = isinstance(layers, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    )
    if not ok or layers != sorted(set(layers)) or any(not 0 <= i < n for i in layers):
        raise ConfigError(
            f"moe_layers: {NAME} needs distinct layer indices 0..{n - 1} in increasing order; "
            f"got {layers!r}"
        )
    return hf_config.placement(layers, n, _PLACEMENT)


def from_hf(hf: Any) -> Config:
    hf_config.refuse_attention_dropout(hf)
    model, moe = hf_config.local_experts_from_hf(hf)
    hf_config.refuse_partial_rotary(model, NAME)
    model.rope_interleave = True
    model.qkv_bias = model.o_bias = bool(getattr(hf, "attention_bias", False))
    model.dense_hidden = hf.intermediate_size_mlp
    _attention(hf, model)
    moe.score_func, moe.topk_before_score, moe.renormalize = "sigmoid", True, False
    moe.score_on_input, moe.num_shared_experts = True, 1
    moe.first_k_dense, moe.moe_every = _placement(hf, model.n_layers)
    return hf_config.finish(model, moe)


FAMILY = Family(
    "llama4_text",
    NAME,
    from_hf,
    to_hf,
    holds=HOLDS,
    layout=LAYOUT,
    # the released checkpoints: the text model (language_model.*) beside a vision tower
    wrapper=Wrapper(
        architecture="Llama4ForConditionalGeneration",
        model_type="llama4",
        config_key="text_config",
        tensors={"language_model.": ""},
        left_out=("vision_model.", "multi_modal_projector."),
        what="the vision tower",
    ),
)
