"""DeepSeek-V4 (DeepseekV4ForCausalLM; V4-Flash and V4-Pro): DeepSeek-V4's compressed attention
(``model.attention: compressed``: one key/value head read as keys and values, a sliding window
on every layer, ``layer_types`` sliding / compressed sparse / heavily compressed with
``compress_rates``, sinks, the grouped output projection ``o_groups`` x ``o_lora_rank``; RoPE in
adjacent pairs, ``rope_theta`` on the sliding layers and ``compress_rope_theta`` with the
``rope_parameters`` YaRN on the compressed ones), manifold-constrained hyper-connections
(``hc_mult`` streams: ``model.hc_streams``), sqrt(softplus) routing with the selection bias
``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``), renormalised, times
``routed_scaling_factor``; hash routing (``mlp_layer_types`` ``hash_moe``: ``moe.hash_layers``,
the ``tid2eid`` table); the clamped SwiGLU (``swiglu_limit``) in the experts and the shared
experts. The files' names are DeepSeek's as released (``embed``, ``layers.<i>.attn.wq_a``,
``attn.kv_norm``, ``ffn.experts.<e>.w1``, ``hc_attn_fn``, ``hc_head_fn``, ``norm``, ``head``: no
``model.`` prefix), which transformers' conversion mapping reads; the names transformers'
``save_pretrained`` writes (``model.`` before the decoder's, ``model.embed_tokens``,
``model.hc_head.hc_fn``, ``attn.norm``) and its in-memory ones are read too. The released
weights are block-quantized (fp8, FP4 experts: :mod:`moetrain.convert.quantized`). The files'
multi-token-
prediction layers (``num_nextn_predict_layers``), which transformers' class leaves out, cannot
be held beside hyper-connections (``model.mtp_depth`` is refused with ``model.hc_streams``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from moetrain.config import Config, ConfigError
from moetrain.config.layer_plan import CSA, HCA, SLIDING, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import SHARED_SIZED_BY_COUNT
from moetrain.convert.families.holds import ANY, free, only, refused_when
from moetrain.convert.families.layout import SWIGLU, Layout, PerExpert

NAME = "DeepseekV4ForCausalLM"
HASH, ROUTED = "hash_moe", "moe"
HC_TENSORS = ("fn", "base", "scale")
HOLDS = {
    "model.attention": only(
        "compressed", why="{name} has compressed attention; must be compressed"
    ),
    "model.sliding_window": ANY,
    "model.partial_rotary_factor": ANY,
    "model.rope_scaling": ANY,
    "model.hc_streams": refused_when(
        lambda m, _: m.hc_streams < 2, "{name} has hyper-connections; must be >= 2"
    ),
    "model.ffn_activation": only("clamped_swiglu"),
    "moe.score_func": only("sqrtsoftplus"),
    "moe.hash_layers": ANY,
    "moe.activation": only("clamped_swiglu"),
    "moe.swiglu_up_offset": only(0.0),
    **free("moe.route_scale", "moe.bias_update_rate"),
    "moe.num_shared_experts": only(1, why="{name} has one shared expert; must be 1"),
    "moe.shared_expert_hidden": SHARED_SIZED_BY_COUNT,
}
# the files' names (DeepSeek's) where they are not transformers' in-memory ones: the
# attention's (of the compressed mixer) ...
_ATTENTION = {
    f"self_attn.{theirs}": f"attn.{ours}"
    for theirs, ours in (
        ("q_a_proj", "wq_a"),
        ("q_a_norm", "q_norm"),
        ("q_b_proj", "wq_b"),
        ("kv_proj", "wkv"),
        ("kv_norm", "kv_norm"),
        ("o_a_proj", "wo_a"),
        ("o_b_proj", "wo_b"),
        ("sinks", "attn_sink"),
        ("compressor.indexer.kv_proj", "indexer.compressor.wkv"),
        ("compressor.indexer.gate_proj", "indexer.compressor.wgate"),
        ("compressor.indexer.position_bias", "indexer.compressor.ape"),
        ("compressor.indexer.kv_norm", "indexer.compressor.norm"),
        ("compressor.indexer.q_b_proj", "indexer.wq_b"),
        ("compressor.indexer.scorer.weights_proj", "indexer.weights_proj"),
        ("compressor.kv_proj", "compressor.wkv"),
        ("compressor.gate_proj", "compressor.wgate"),
        ("compressor.position_bias", "compressor.ape"),
        ("compressor.kv_norm", "compressor.norm"),
    )
}
# ... and the block's others (the in-memory layout keeps its own: in_memory_renames)
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    **{f"{hc}.{t}": f"hc_{hc[:-3]}_{t}" for hc in ("attn_hc", "ffn_hc") for t in HC_TENSORS},
    **{f"ffn.shared_experts.{p}": f"ffn.shared_experts.{w}" for w, p in SWIGLU.items()},
}
# transformers' save_pretrained: its conversion mapping run backwards (``.norm.`` ->
# ``.kv_norm.`` undone on the attention's own norm too; the anchored top-level renames not)
SAVED = Layout(
    lm_head="head",
    moe_block="ffn",
    shared_expert="shared_experts",
    selection_bias="gate.bias",
    experts=PerExpert({w: w for w in SWIGLU}),
    mixer_renames={"compressed": {**_ATTENTION, "self_attn.kv_norm": "attn.norm"}},
    renames=_BLOCK,
)
_HYPER_HEAD = {f"hc_head_{t}": f"hc_head.hc_{t}" for t in HC_TENSORS}
LAYOUT = dataclasses.replace(
    SAVED,
    base="",
    embed="embed",
    final_norm="norm",
    hyper_head=tuple(_HYPER_HEAD),
    mixer_renames={"compressed": _ATTENTION},
    in_memory_renames={name: name for name in _BLOCK},
    in_memory={
        "": "model.",
        "embed": "embed_tokens",
        "head": "lm_head",
        "ffn": "mlp",
        "gate.bias": "gate.e_score_correction_bias",
        **_HYPER_HEAD,
    },
    saved=SAVED,
)


def _hash_layers(cfg: Config) -> list[str]:
    hashed = set(cfg.moe.hash_layers or ())
    return [HASH if i in hashed else ROUTED for i in range(cfg.model.n_layers)]


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    common = {k: v for k, v in hf_config.hf_common(cfg).items() if k != "rope_parameters"}
    compress: dict[str, Any] = {"rope_theta": model.compress_rope_theta}
    if model.rope_scaling == "yarn":
        compress = {**hf_config.rope_parameters(model), **compress, "attention_factor": 1.0}
    compress = {**compress, "partial_rotary_factor": model.partial_rotary_factor}
    main = {"rope_type": "default", "rope_theta": model.rope_theta}
    main["partial_rotary_factor"] = model.partial_rotary_factor
    rates = {CSA: model.compress_rate_csa, HCA: model.compress_rate_hca}
    return dict(
        common,
        rope_theta=model.rope_theta,
        compress_rope_theta=model.compress_rope_theta,
        rope_parameters={"main": main, "compress": {"rope_type": "default", **compress}},
        partial_rotary_factor=model.partial_rotary_factor,
        q_lora_rank=model.q_lora_rank,
        o_groups=model.o_groups,
        o_lora_rank=model.o_lora_rank,
        sliding_window=model.sliding_window,
        layer_types=layer_types(model),
        compress_rates=rates,
        index_n_heads=model.compress_index_heads or 1,
        index_head_dim=model.compress_index_head_dim or model.head_dim,
        index_topk=model.compress_index_topk or 1,
        hc_mult=model.hc_streams,
        hc_sinkhorn_iters=model.hc_sinkhorn_iters,
        hc_eps=model.hc_eps,
        moe_intermediate_size=moe.expert_hidden,
        n_routed_experts=moe.num_experts,
        n_shared_experts=1,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=moe.renormalize,
        routed_scaling_factor=moe.route_scale,
        mlp_layer_types=_hash_layers(cfg),
        swiglu_limit=moe.swiglu_limit,
        num_nextn_predict_layers=0,
        attention_bias=False,
    )


def _rope(hf: Any, which: str) -> dict[str, Any]:
    return dict((getattr(hf, "rope_parameters", None) or {}).get(which) or {})


def from_hf(hf: Any) -> Config:
    hf_config.refuse_attention_bias(hf)
    hf_config.refuse_attention_dropout(hf)
    compress = _rope(hf, "compress")
    if compress.get("rope_type", "default") not in ("default", "yarn"):
        raise ConfigError(
            f"rope_parameters.compress.rope_type: {NAME}'s compressed layers take YaRN or "
            f"plain RoPE; got {compress.get('rope_type')!r}"
        )
    if compress.get("attention_factor", 1.0) != 1.0:
        raise ConfigError(
            "rope_parameters.compress.attention_factor: moetrain's compressed layers leave "
            f"cos / sin unscaled (1.0); got {compress['attention_factor']}"
        )
    compress.pop("attention_factor", None)
    view = hf_config.WithRope(hf, compress)
    model, moe = hf_config.model_from_hf(view), hf_config.moe_from_hf(hf)
    main = _rope(hf, "main")
    model.rope_theta = float(main.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    model.compress_rope_theta = float(compress.get("rope_theta", hf.compress_rope_theta))
    model.partial_rotary_factor = float(hf.partial_rotary_factor)
    model.attention, model.n_kv_heads = "compressed", 1
    model.q_lora_rank, model.o_groups, model.o_lora_rank = (
        hf.q_lora_rank,
        hf.o_groups,
        hf.o_lora_rank,
    )
    types = list(hf.layer_types)
    unknown = sorted(set(types) - {SLIDING, CSA, HCA})
    if unknown:
        raise ConfigError(f"layer_types: {NAME} knows {SLIDING}, {CSA}, {HCA}; got {unknown}")
    model.layer_types, model.sliding_window = types, hf.sliding_window
    rates = dict(hf.compress_rates)
    model.compress_rate_csa, model.compress_rate_hca = rates[CSA], rates[HCA]
    if CSA in types:
        model.compress_index_heads, model.compress_index_head_dim = (
            hf.index_n_heads,
            hf.index_head_dim,
        )
        model.compress_index_topk = hf.index_topk
    model.hc_streams, model.hc_sinkhorn_iters = hf.hc_mult, hf.hc_sinkhorn_iters
    model.hc_eps = float(hf.hc_eps)
    model.ffn_activation = "clamped_swiglu"
    if hf.scoring_func != "sqrtsoftplus":
        raise ConfigError(f"scoring_func: {NAME} routes with sqrtsoftplus; got {hf.scoring_func}")
    moe.score_func, moe.renormalize = "sqrtsoftplus", bool(hf.norm_topk_prob)
    moe.num_experts, moe.expert_hidden = hf.n_routed_experts, hf.moe_intermediate_size
    moe.route_scale = float(hf.routed_scaling_factor)
    if int(hf.n_shared_experts) != 1:  # (its class builds one whatever the field says)
        raise ConfigError(
            f"n_shared_experts: {NAME} has one shared expert; got {hf.n_shared_experts}"
        )
    moe.num_shared_experts, moe.shared_expert_hidden = 1, moe.expert_hidden
    moe.hash_layers = [i for i, t in enumerate(hf.mlp_layer_types) if t == HASH] or None
    moe.activation, moe.swiglu_alpha = "clamped_swiglu", 1.0
    moe.swiglu_limit, moe.swiglu_up_offset = float(hf.swiglu_limit), 0.0
    return hf_config.finish(model, moe)


FAMILY = Family("deepseek_v4", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
