"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM): multi-head latent attention as DeepSeek-V3's
(:mod:`deepseek_v3`) with interleaved rotary pairs, plain or YaRN RoPE; softmax scores, top-k
without renormalisation (transformers' DeepSeek-V2 never renormalises, whatever
``norm_topk_prob`` says), ``routed_scaling_factor`` = ``moe.route_scale``, ``topk_method``
``greedy`` or ``group_limited_greedy`` (a group scored by its best expert: ``moe.group_score:
max``), no selection bias, ungated shared experts, the first ``first_k_dense_replace`` layers
dense."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import base, hf_config
from moetrain.convert.families.base import Family, WeightNames
from moetrain.convert.families.deepseek_v3 import mla_from_hf, mla_hf, shared_experts

NAME = "DeepseekV2ForCausalLM"


def problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    return base.found(
        [
            base.dropless(moe, NAME),
            (
                not model.rope_interleave,
                "model.rope_interleave",
                f"{NAME} rotates interleaved pairs; must be true",
            ),
            (moe.score_func != "softmax", "moe.score_func", f"{NAME} routes with softmax"),
            (
                moe.topk_before_score,
                "moe.topk_before_score",
                f"{NAME} takes softmax over all experts, then top-k; must be false",
            ),
            (moe.renormalize, "moe.renormalize", f"{NAME} never renormalises; must be false"),
            (
                moe.bias_update_rate != 0.0,
                "moe.bias_update_rate",
                f"{NAME} has no expert bias (aux-loss-free balancing); must be 0",
            ),
            (
                moe.n_group > 1 and moe.group_score != "max",
                "moe.group_score",
                f"{NAME} scores a group by its best expert; must be max",
            ),
            *shared_experts(moe, NAME),
        ]
    )


def to_hf(cfg: Config) -> dict[str, Any]:
    grouped = cfg.moe.n_group > 1
    return dict(
        mla_hf(cfg),
        topk_method="group_limited_greedy" if grouped else "greedy",
        scoring_func="softmax",  # as released (transformers' class has no other; vLLM reads it)
        norm_topk_prob=False,
    )


def from_hf(hf: Any) -> Config:
    model, moe = mla_from_hf(hf)
    method = getattr(hf, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(
            f"topk_method: {NAME} routes greedy or group_limited_greedy; got {method}"
        )
    if method == "greedy":
        moe.n_group, moe.topk_group = 1, 1
    model.rope_interleave = True
    moe.score_func, moe.renormalize, moe.group_score = "softmax", False, "max"
    return hf_config.finish(model, moe)


FAMILY = Family(
    name="deepseek_v2",
    architecture=NAME,
    from_hf=from_hf,
    problems=problems,
    to_hf=to_hf,
    names=WeightNames(shared_expert="shared_experts"),
    attention="mla",
    rope_interleave=None,  # (its own check: must be true)
)
