"""LFM2-MoE (Lfm2MoeForCausalLM; LiquidAI's LFM2-8B-A1B): hybrid layers, gated short
convolutions (``model.linear_attention: gated_conv``) in the ``conv`` layers of
``layer_types`` and grouped-query attention with a per-head query/key RMSNorm before RoPE
(``model.qk_norm``) in the ``full_attention`` ones (transformers' ``conv`` is moetrain's
``linear_attention``); the head size ``hidden_size / num_attention_heads``; the first
``num_dense_layers`` layers dense, then a sigmoid router choosing on the scores shifted by the
selection bias ``feed_forward.expert_bias`` (moetrain's aux-loss-free ``expert_bias``), weights
from the unbiased scores, renormalised with ``norm_topk_prob`` by their sum plus 1e-6
(``moe.renormalize_eps``), times ``routed_scaling_factor``; no shared experts; tied
embeddings as released (``tie_embedding``).

Weights: the block's norms ``operator_norm`` / ``ffn_norm``, the final norm
``model.embedding_norm``, the attention's ``self_attn.{q,k,v,out}_proj`` and
``self_attn.{q,k}_layernorm``, the convolution's ``conv.{in_proj, conv, out_proj}``, the FFN
``feed_forward`` (dense ``w1``, ``w3``, ``w2``; per-expert ``experts.<e>.{w1,w3,w2}``, the
router ``gate``); transformers v5 holds the experts fused in memory."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.layer_plan import FULL, LINEAR, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ANY, free, only, refused_when
from moetrain.convert.families.layout import Layout, PerExpert

NAME = "Lfm2MoeForCausalLM"
TYPES = {"conv": LINEAR, FULL: FULL}  # its files' layer types -> moetrain's
RELEASED_TYPES = {LINEAR: "conv", FULL: FULL}
RENORMALIZE_EPS = 1e-6  # added to the top-k weights' sum by its router


def _has_conv(model: ModelConfig) -> bool:
    return LINEAR in layer_types(model)


HOLDS = {
    **free("moe.first_k_dense", "moe.route_scale"),
    "model.layer_types": refused_when(
        lambda m, _: any(t not in RELEASED_TYPES for t in layer_types(m)),
        "{name} has a gated convolution (linear_attention) or full attention in every layer",
    ),
    "model.linear_attention": only(
        "gated_conv",
        applies=lambda m, _: _has_conv(m),
        why="{name}'s conv layers are gated short convolutions; must be gated_conv",
    ),
    "model.head_dim": refused_when(
        lambda m, _: m.attention_head_dim * m.n_heads != m.d_model,
        "{name}'s head size is hidden_size / num_attention_heads (model.d_model={model.d_model} "
        "/ model.n_heads={model.n_heads}); leave it null",
    ),
    "model.qk_norm": only(True),
    "moe.score_func": only("sigmoid"),
    "moe.renormalize_eps": refused_when(
        lambda _, moe: moe.renormalize_eps != (RENORMALIZE_EPS if moe.renormalize else 0.0),
        "{name} renormalises by the top-k weights' sum plus 1e-6; must be 1e-6 with "
        "moe.renormalize=true",
    ),
    "moe.bias_update_rate": ANY,
}
LAYOUT = Layout(
    moe_block="feed_forward",
    dense_block="feed_forward",
    experts=PerExpert({"w1": "w1", "w3": "w3", "w2": "w2"}),
    selection_bias="expert_bias",
    final_norm="model.embedding_norm",
    renames={
        "input_layernorm": "operator_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.o_proj": "self_attn.out_proj",
        "self_attn.q_norm": "self_attn.q_layernorm",
        "self_attn.k_norm": "self_attn.k_layernorm",
        "feed_forward.gate_proj": "feed_forward.w1",
        "feed_forward.up_proj": "feed_forward.w3",
        "feed_forward.down_proj": "feed_forward.w2",
    },
)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    fields = hf_config.hf_common(cfg)
    for key in ("head_dim", "rms_norm_eps", "tie_word_embeddings", "router_aux_loss_coef"):
        fields.pop(key)
    return dict(
        fields,
        norm_eps=model.norm_eps,
        tie_embedding=model.tie_embeddings,  # (its released key; the class reads it too)
        intermediate_size=model.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        num_experts=moe.num_experts,
        num_dense_layers=moe.first_k_dense,
        routed_scaling_factor=moe.route_scale,
        norm_topk_prob=moe.renormalize,
        use_expert_bias=True,
        layer_types=[RELEASED_TYPES[t] for t in layer_types(model)],
        conv_L_cache=model.gated_conv_kernel,
        conv_bias=model.gated_conv_bias,
    )


class _AsLlama:
    """An LFM2-MoE config read through Llama's field names (its ``norm_eps``)."""

    def __init__(self, hf: Any) -> None:
        self._hf, self.rms_norm_eps = hf, hf.norm_eps

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_dropout(hf)
    if not get("use_expert_bias", True):
        raise ConfigError(
            f"use_expert_bias: moetrain's sigmoid router selects with its selection bias "
            f"(zeros where the files have none); {NAME} without it holds no "
            f"feed_forward.expert_bias tensor to read; got false"
        )
    model, moe = hf_config.model_from_hf(_AsLlama(hf)), hf_config.moe_from_hf(hf)
    hf_config.refuse_partial_rotary(model, NAME)
    if model.attention_head_dim * model.n_heads != model.d_model:
        raise ConfigError(
            f"head_dim: {NAME}'s head size is hidden_size / num_attention_heads; got "
            f"{model.head_dim}"
        )
    types = list(get("layer_types") or [])
    if len(types) != model.n_layers or set(types) - set(TYPES):
        raise ConfigError(
            f"layer_types: {NAME} needs conv or full_attention per layer "
            f"(num_hidden_layers={model.n_layers}); got {types}"
        )
    model.layer_types = [TYPES[t] for t in types]
    model.head_dim, model.qk_norm = None, True
    if _has_conv(model):
        model.linear_attention = "gated_conv"
        model.gated_conv_kernel = hf_config.hf_number(
            hf, "conv_L_cache", NAME, integer=True, positive=True
        )
        model.gated_conv_bias = bool(get("conv_bias", False))
    moe.num_experts, moe.expert_hidden = hf.num_experts, hf.moe_intermediate_size
    moe.score_func, moe.renormalize = "sigmoid", bool(get("norm_topk_prob", True))
    moe.renormalize_eps = RENORMALIZE_EPS if moe.renormalize else 0.0
    moe.route_scale = float(
        hf_config.hf_number(hf, "routed_scaling_factor", NAME, 1.0, positive=True)
    )
    dense = hf_config.hf_number(hf, "num_dense_layers", NAME, 0, integer=True)
    moe.first_k_dense = min(dense, model.n_layers)
    return hf_config.finish(model, moe)


FAMILY = Family("lfm2_moe", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
