"""MiMo-V2-Flash (MiMoV2FlashForCausalLM; Xiaomi's MiMo-V2-Flash): full and sliding-window
attention layers (``layer_types``, released the first and every sixth full), query/key heads of
``head_dim`` (192) beside value heads of ``v_head_dim`` (128: ``model.v_head_dim``), twice the
key/value heads on the sliding layers (``model.sliding_n_kv_heads``), a learned sink logit per
head on the sliding layers only (``self_attn.attention_sink_bias`` in the files, ``sinks`` in
transformers' memory: ``model.attention_sinks`` with
``model.attention_sinks_layers: sliding``), a RoPE theta per layer type (``rope_parameters``
keyed by layer type: ``model.rope_theta`` for the full layers, ``model.sliding_rope_theta`` for
the sliding ones), partial rotary (``partial_rotary_factor``, default 0.334: the first
``int(head_dim * factor)`` dims), values multiplied by ``attention_value_scale``
(``model.attention_value_scale``); DeepSeek-V3's router (sigmoid scores, the selection bias
``gate.e_score_correction_bias``, optional groups, ``norm_topk_prob``, ``routed_scaling_factor``)
over experts without shared ones, each layer's FFN dense or MoE by ``mlp_layer_types``.

The released files also hold multi-token-prediction layers under ``model.mtp.``, which
transformers' class does not load (its ``_keys_to_ignore_on_load_unexpected``): an import
leaves them unread where ``config.json`` declares them, and ``model.mtp_depth`` is refused on
export (the class has nowhere to hold them)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.layer_plan import FULL, SLIDING, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import SIGMOID_GROUPS
from moetrain.convert.families.holds import free, only, refused_when
from moetrain.convert.families.layout import Layout

NAME = "MiMoV2FlashForCausalLM"
DEFAULT_PARTIAL = 0.334  # transformers' partial_rotary_factor where rope_parameters has none
_MLP_TYPES = {"dense": "dense", "sparse": "moe"}


def _sliding(model: ModelConfig) -> bool:
    return SLIDING in layer_types(model)


def _dense_first(kinds: list[str]) -> int | None:
    """How many dense layers ``kinds`` (``dense`` / ``moe`` per layer) begins with, where the
    rest are MoE; None for another pattern."""
    dense = kinds.index("moe") if "moe" in kinds else len(kinds)
    return dense if kinds == ["dense"] * dense + ["moe"] * (len(kinds) - dense) else None


HOLDS = {
    **free(
        "model.sliding_window",
        "model.partial_rotary_factor",
        "model.v_head_dim",
        "model.attention_value_scale",
        "model.sliding_rope_theta",
        "moe.first_k_dense",
        "moe.moe_every",
        "moe.route_scale",
        "moe.renormalize",
    ),
    "model.rope_scaling": only(
        "none", why="{name} computes default RoPE per layer type here; must be none"
    ),
    "model.sliding_n_kv_heads": refused_when(
        lambda m, _: _sliding(m) and m.sliding_n_kv_heads != 2 * m.n_kv_heads,
        "{name} has twice model.n_kv_heads={model.n_kv_heads} key/value heads on its sliding "
        "layers: must be their double",
    ),
    "model.attention_sinks": refused_when(
        lambda m, _: m.attention_sinks != _sliding(m),
        "{name} has a sink per head on its sliding layers and none elsewhere: must be true "
        "exactly where model.layer_types has sliding_attention layers",
    ),
    "model.attention_sinks_layers": only("sliding", applies=lambda m, _: m.attention_sinks),
    "moe.layer_ffns": refused_when(
        lambda _, moe: (
            moe.layer_ffns is not None
            and ("none" in moe.layer_ffns or _dense_first(moe.layer_ffns) is not None)
        ),
        "{name} has a dense MLP or an MoE in every layer, dense first layers by "
        "moe.first_k_dense: layer_ffns only for another pattern, without none",
    ),
    **SIGMOID_GROUPS,
}
# the files name the sinks attention_sink_bias (transformers renames them to sinks on load)
LAYOUT = Layout(
    selection_bias="gate.e_score_correction_bias",
    renames={"self_attn.sinks": "self_attn.attention_sink_bias"},
    in_memory_renames={"self_attn.sinks": "self_attn.sinks"},
)


def _rope_entry(theta: float, factor: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    factor = model.partial_rotary_factor
    sliding_theta = model.sliding_rope_theta or model.rope_theta
    types = hf_config.layer_types(model)
    moe_layers = [int(moe.is_moe_layer(i)) for i in range(model.n_layers)]
    v_dim = model.v_head_dim or model.attention_head_dim
    return dict(
        hf_config.hf_common(cfg),
        **_serving_keys(cfg, types, moe_layers, v_dim, sliding_theta),
        intermediate_size=model.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        n_routed_experts=moe.num_experts,
        # (released null for 1.0, which transformers reads so)
        routed_scaling_factor=None if moe.route_scale == 1.0 else moe.route_scale,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=moe.renormalize,
        v_head_dim=v_dim,
        attention_value_scale=model.attention_value_scale,
        layer_types=types,
        sliding_window=model.sliding_window,
        mlp_layer_types=["sparse" if m else "dense" for m in moe_layers],
        rope_parameters={
            FULL: _rope_entry(model.rope_theta, factor),
            SLIDING: _rope_entry(sliding_theta, factor),
        },
        attention_bias=False,
        hidden_act="silu",
    )


def _serving_keys(
    cfg: Config, types: list[str], moe_layers: list[int], v_dim: int, sliding_theta: float
) -> dict[str, Any]:
    """The keys of the released config.json that serving engines read and transformers' class
    does not (it takes the fields above): the layer patterns as 0/1 lists, the sliding layers'
    heads, head dims and theta, which layers have sinks, the routing, the norms' epsilon."""
    model = cfg.model
    sliding = SLIDING in types
    out = dict(
        hybrid_layer_pattern=[int(t == SLIDING) for t in types],
        moe_layer_freq=moe_layers,
        rope_theta=model.rope_theta,
        partial_rotary_factor=model.partial_rotary_factor,
        add_full_attention_sink_bias=False,
        add_swa_attention_sink_bias=sliding,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        layernorm_epsilon=model.norm_eps,
    )
    if sliding:
        out.update(
            swa_num_attention_heads=model.n_heads,
            swa_num_key_value_heads=model.sliding_n_kv_heads,
            swa_head_dim=model.attention_head_dim,
            swa_v_head_dim=v_dim,
            swa_rope_theta=sliding_theta,
            # the window before the query (transformers reads it back as that + 1)
            sliding_window_size=model.sliding_window - 1,
        )
    return out


def _rope_from_hf(hf: Any, model: ModelConfig) -> None:
    """The per-layer-type ``rope_parameters``: default RoPE, one partial factor."""
    rope = getattr(hf, "rope_parameters", None) or {}
    entries = {t: rope.get(t) or {} for t in set(layer_types(model)) | {FULL}}
    factors = set()
    for kind, entry in entries.items():
        if entry.get("rope_type", "default") != "default":
            raise ConfigError(
                f"rope_parameters.{kind}.rope_type: moetrain computes {NAME}'s default RoPE "
                f"per layer type; got {entry.get('rope_type')!r}"
            )
        factors.add(float(entry.get("partial_rotary_factor", DEFAULT_PARTIAL)))
    if len(factors) > 1:
        raise ConfigError(
            f"rope_parameters.*.partial_rotary_factor: moetrain rotates as many dims in every "
            f"layer; got {sorted(factors)}"
        )
    model.partial_rotary_factor = factors.pop()
    model.rope_theta = float(entries[FULL].get("rope_theta", model.rope_theta))
    if SLIDING in entries:
        model.sliding_rope_theta = float(entries[SLIDING].get("rope_theta", model.rope_theta))


def _ffns_from_hf(hf: Any, n_layers: int, moe: Any) -> None:
    """``mlp_layer_types``: dense first layers (``moe.first_k_dense``), else each layer's
    (``moe.layer_ffns``)."""
    types = list(getattr(hf, "mlp_layer_types", None) or ["dense"] + ["sparse"] * (n_layers - 1))
    unknown = sorted(set(types) - set(_MLP_TYPES))
    if unknown or len(types) != n_layers:
        raise ConfigError(f"mlp_layer_types: {n_layers} entries of dense / sparse; got {types!r}")
    kinds = [_MLP_TYPES[t] for t in types]
    dense = _dense_first(kinds)
    if dense is not None:
        moe.first_k_dense = dense
    else:
        moe.layer_ffns = kinds


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_dropout(hf)
    hf_config.refuse_attention_bias(hf)
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    hf_config.windows_from_hf(hf, model)
    _rope_from_hf(hf, model)
    sliding = _sliding(model)
    if sliding:
        model.sliding_n_kv_heads = 2 * model.n_kv_heads
        model.attention_sinks, model.attention_sinks_layers = True, "sliding"
    else:
        model.sliding_rope_theta = None
    v_dim = int(get("v_head_dim", None) or model.attention_head_dim)
    model.v_head_dim = None if v_dim == model.attention_head_dim else v_dim
    scale = get("attention_value_scale", None)
    model.attention_value_scale = 1.0 if scale is None else float(scale)
    moe.num_experts, moe.expert_hidden = hf.n_routed_experts, hf.moe_intermediate_size
    moe.score_func, moe.renormalize = "sigmoid", bool(get("norm_topk_prob", True))
    moe.route_scale = float(get("routed_scaling_factor", None) or 1.0)
    moe.n_group, moe.topk_group = int(get("n_group", 1) or 1), int(get("topk_group", 1) or 1)
    _ffns_from_hf(hf, model.n_layers, moe)
    return hf_config.finish(model, moe)


FAMILY = Family("mimo_v2_flash", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
