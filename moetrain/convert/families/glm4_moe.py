"""GLM-4-MoE (Glm4MoeForCausalLM): sigmoid scores, selection shifted by
``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``), weights from the unbiased
scores, optional renormalisation, ``routed_scaling_factor`` = ``moe.route_scale``, ungated shared
experts, the first ``first_k_dense_replace`` layers dense, group-limited routing ``n_group`` /
``topk_group`` = ``moe.n_group`` / ``moe.topk_group`` (a group scored by its two best biased
scores, the other groups' experts excluded), rotary over the first ``partial_rotary_factor`` of
each head (``model.partial_rotary_factor``; GLM-4.5's 0.5), q/k/v biases with
``attention_bias`` (``model.qkv_bias``; the output projection has none). The
multi-token-prediction layers of a released GLM-4.5 (``num_nextn_predict_layers``) are not
imported."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ModelConfig, MoEConfig
from moetrain.convert.families import base, hf_config
from moetrain.convert.families.base import Family, WeightNames

NAME = "Glm4MoeForCausalLM"


def problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    return base.found(
        [
            base.dropless(moe, NAME),
            (moe.score_func != "sigmoid", "moe.score_func", f"{NAME} routes with sigmoid"),
            (
                moe.topk_before_score,
                "moe.topk_before_score",
                f"{NAME} picks top-k on the (biased) scores; must be false",
            ),
            base.per_head_norm(model, NAME),
            (
                moe.moe_every != 1,
                "moe.moe_every",
                f"{NAME} has MoE in every layer after first_k_dense_replace; must be 1",
            ),
            (moe.num_experts < 2, "moe.num_experts", f"{NAME}'s group scoring needs >= 2"),
            (
                moe.n_group > 1 and moe.num_experts // moe.n_group < 2,
                "moe.n_group",
                f"{NAME} scores a group by its two best experts: groups need >= 2 experts",
            ),
            (
                moe.n_group > 1 and moe.group_score != "top2_sum",
                "moe.group_score",
                f"{NAME} scores a group by the sum of its two best experts; must be top2_sum",
            ),
            (
                moe.num_shared_experts == 0,
                "moe.num_shared_experts",
                f"{NAME} always has shared experts; must be >= 1",
            ),
            (moe.shared_expert_gate, "moe.shared_expert_gate", f"{NAME} does not gate them"),
            (
                moe.num_shared_experts > 0
                and moe.shared_hidden != moe.num_shared_experts * moe.expert_hidden,
                "moe.shared_expert_hidden",
                f"{NAME} sizes shared experts as n_shared_experts x moe_intermediate_size; "
                "must be null or num_shared_experts * expert_hidden",
            ),
        ]
    )


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe, fields = cfg.model, cfg.moe, hf_config.hf_common(cfg)
    fields["rope_parameters"] = dict(
        fields["rope_parameters"], partial_rotary_factor=model.partial_rotary_factor
    )
    return dict(
        fields,
        intermediate_size=model.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        n_routed_experts=moe.num_experts,
        n_shared_experts=moe.num_shared_experts,
        routed_scaling_factor=moe.route_scale,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        first_k_dense_replace=moe.first_k_dense,
        norm_topk_prob=moe.renormalize,
        use_qk_norm=model.qk_norm,
        attention_bias=model.qkv_bias,
        num_mtp_layers=model.mtp_depth,
    )


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    moe.n_group, moe.topk_group = int(get("n_group", 1)), int(get("topk_group", 1))
    model.qkv_bias = bool(get("attention_bias", False))
    moe.num_experts, moe.expert_hidden = hf.n_routed_experts, hf.moe_intermediate_size
    moe.score_func, moe.renormalize = "sigmoid", bool(get("norm_topk_prob", True))
    moe.route_scale = float(get("routed_scaling_factor", 1.0))
    moe.num_shared_experts = hf.n_shared_experts
    moe.first_k_dense = hf.first_k_dense_replace
    model.qk_norm = bool(get("use_qk_norm", False))
    return hf_config.finish(model, moe)


FAMILY = Family(
    name="glm4_moe",
    architecture=NAME,
    from_hf=from_hf,
    problems=problems,
    to_hf=to_hf,
    names=WeightNames(shared_expert="shared_experts", expert_bias="gate.e_score_correction_bias"),
    partial_rotary=True,
    mtp=True,
)
