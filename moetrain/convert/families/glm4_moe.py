"""GLM-4-MoE (Glm4MoeForCausalLM): sigmoid scores, selection shifted by
``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``), weights from the unbiased
scores, optional renormalisation, ``routed_scaling_factor`` = ``moe.route_scale``, ungated shared
experts, the first ``first_k_dense_replace`` layers dense, group-limited routing ``n_group`` /
``topk_group`` = ``moe.n_group`` / ``moe.topk_group`` (a group scored by its two best biased
scores, the other groups' experts excluded), rotary over the first ``partial_rotary_factor`` of
each head (``model.partial_rotary_factor``; GLM-4.5's 0.5), q/k/v biases with
``attention_bias`` (``model.qkv_bias``; the output projection has none). Its files name its
weights and multi-token-prediction layers as DeepSeek-V3's."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import (
    DEEPSEEK_MOE,
    LAYOUT,
    SIGMOID_GROUPS,
    deepseek_moe_from_hf,
    deepseek_moe_hf,
)
from moetrain.convert.families.holds import free, refused_when

NAME = "Glm4MoeForCausalLM"
HOLDS = {
    **free("model.partial_rotary_factor", "model.qkv_bias", "model.qk_norm"),
    **SIGMOID_GROUPS,
    "moe.num_experts": refused_when(
        lambda _, moe: moe.num_experts < 2, "{name}'s group scoring needs >= 2"
    ),
    **DEEPSEEK_MOE,
}


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe, fields = cfg.model, cfg.moe, hf_config.hf_common(cfg)
    fields["rope_parameters"] = dict(
        fields["rope_parameters"], partial_rotary_factor=model.partial_rotary_factor
    )
    return dict(
        fields,
        **deepseek_moe_hf(cfg),
        norm_topk_prob=moe.renormalize,
        use_qk_norm=model.qk_norm,
        attention_bias=model.qkv_bias,
        num_mtp_layers=model.mtp_depth,
    )


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    deepseek_moe_from_hf(hf, moe, model.n_layers)
    model.qkv_bias = bool(get("attention_bias", False))
    moe.score_func, moe.renormalize = "sigmoid", bool(get("norm_topk_prob", True))
    model.qk_norm = bool(get("use_qk_norm", False))
    return hf_config.finish(model, moe)


FAMILY = Family("glm4_moe", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
