"""DeepSeek-V3 (DeepseekV3ForCausalLM; also DeepSeek-R1 / V3.1, Kimi K2, Moonlight): multi-head
latent attention (``model.attention=mla``: the optional query LoRA, the compressed KV latent,
the head-shared rotary key, ``rope_interleave``), plain or YaRN RoPE, sigmoid scores with the
selection bias ``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``),
group-limited routing scored by each group's two best experts, optional renormalisation,
``routed_scaling_factor`` = ``moe.route_scale``, ungated shared experts, the first
``first_k_dense_replace`` layers dense. The multi-token-prediction layers of a released
checkpoint (``num_nextn_predict_layers``), which transformers' model leaves out, are moetrain's
``model.mtp_depth`` modules, read and written in their released layout (:data:`LAYOUT`)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import (
    ANY,
    GROUPS_OF_TWO,
    LATENT_ATTENTION,
    SHARED_EXPERTS_ALWAYS,
    SHARED_SIZED_BY_COUNT,
    free,
    only,
)
from moetrain.convert.families.layout import Layout, MtpNames

NAME = "DeepseekV3ForCausalLM"
# DeepSeek's MoE (V2's and GLM-4.5's too): a route scale, ungated shared experts sized
# n_shared_experts x moe_intermediate_size, the first layers dense
DEEPSEEK_MOE = {
    **free("moe.route_scale", "moe.first_k_dense"),
    "moe.num_shared_experts": SHARED_EXPERTS_ALWAYS,
    "moe.shared_expert_hidden": SHARED_SIZED_BY_COUNT,
}
# sigmoid scores with a selection bias, group-limited by each group's two best (GLM-4.5's too)
SIGMOID_GROUPS = {
    "moe.score_func": only("sigmoid"),
    "moe.bias_update_rate": ANY,
    **GROUPS_OF_TWO,
}
HOLDS = {
    **LATENT_ATTENTION,
    "model.rope_interleave": ANY,
    **SIGMOID_GROUPS,
    **DEEPSEEK_MOE,
}
# the router's selection bias, and the multi-token-prediction layers (GLM-4.5's names too)
LAYOUT = Layout(
    shared_expert="shared_experts",
    selection_bias="gate.e_score_correction_bias",
    mtp=MtpNames(),
)


def deepseek_moe_hf(cfg: Config) -> dict[str, Any]:
    """The MoE fields of DeepSeek's MoE (V2's, V3's, GLM-4.5's, dots.llm1's): shape, shared
    experts, route scale, groups, the first dense layers."""
    moe = cfg.moe
    return dict(
        intermediate_size=cfg.model.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        n_routed_experts=moe.num_experts,
        n_shared_experts=moe.num_shared_experts,
        routed_scaling_factor=moe.route_scale,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        first_k_dense_replace=moe.first_k_dense,
    )


def deepseek_moe_from_hf(hf: Any, moe: MoEConfig, n_layers: int) -> None:
    """Set ``moe`` from the fields :func:`deepseek_moe_hf` writes (unset groups: none)."""

    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default) or default

    moe.num_experts, moe.expert_hidden = hf.n_routed_experts, hf.moe_intermediate_size
    moe.route_scale = float(get("routed_scaling_factor", 1.0))
    moe.n_group, moe.topk_group = int(get("n_group", 1)), int(get("topk_group", 1))
    moe.num_shared_experts = int(get("n_shared_experts", 0))
    moe.first_k_dense = min(int(get("first_k_dense_replace", 0)), n_layers)


def mla_hf(cfg: Config) -> dict[str, Any]:
    """The transformers fields both DeepSeek families share (attention, RoPE, MoE shape)."""
    model = cfg.model
    fields = {k: v for k, v in hf_config.hf_common(cfg).items() if k != "head_dim"}
    return dict(
        fields,
        **deepseek_moe_hf(cfg),
        moe_layer_freq=1,  # as released (every layer after the dense ones; vLLM reads it)
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        attention_bias=False,
    )


def to_hf(cfg: Config) -> dict[str, Any]:
    return dict(
        mla_hf(cfg),
        # as released: transformers' class routes this way whatever the keys say, other
        # readers (vLLM) take the sigmoid scores and the selection bias from them
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=cfg.moe.renormalize,
        rope_interleave=cfg.model.rope_interleave,
        num_mtp_layers=cfg.model.mtp_depth,
    )


def mla_from_hf(hf: Any) -> tuple[ModelConfig, MoEConfig]:
    """The model and MoE sections both DeepSeek families share."""

    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_bias(hf)
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    model.attention, model.head_dim, model.n_kv_heads = "mla", None, model.n_heads
    model.q_lora_rank, model.kv_lora_rank = get("q_lora_rank", None), hf.kv_lora_rank
    model.qk_nope_head_dim, model.qk_rope_head_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim
    model.v_head_dim = hf.v_head_dim
    deepseek_moe_from_hf(hf, moe, model.n_layers)
    return model, moe


def from_hf(hf: Any) -> Config:
    model, moe = mla_from_hf(hf)
    if getattr(hf, "scoring_func", "sigmoid") not in (None, "sigmoid"):
        raise ConfigError(f"scoring_func: {NAME} routes with sigmoid; got {hf.scoring_func}")
    model.rope_interleave = bool(getattr(hf, "rope_interleave", True))
    moe.score_func, moe.renormalize = "sigmoid", bool(getattr(hf, "norm_topk_prob", True))
    return hf_config.finish(model, moe)


FAMILY = Family("deepseek_v3", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
