"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM): multi-head latent attention as DeepSeek-V3's
(:mod:`deepseek_v3`) with interleaved rotary pairs, plain or YaRN RoPE; softmax scores, top-k
without renormalisation (transformers' DeepSeek-V2 never renormalises, whatever
``norm_topk_prob`` says), ``routed_scaling_factor`` = ``moe.route_scale``, ``topk_method``
``greedy`` or ``group_limited_greedy`` (a group scored by its best expert: ``moe.group_score:
max``), no selection bias, ungated shared experts, the first ``first_k_dense_replace`` layers
dense."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import DEEPSEEK_MOE, mla_from_hf, mla_hf
from moetrain.convert.families.holds import ANY, LATENT_ATTENTION, only
from moetrain.convert.families.layout import Layout

NAME = "DeepseekV2ForCausalLM"
HOLDS = {
    **LATENT_ATTENTION,
    "model.rope_interleave": only(True),
    "moe.renormalize": only(False),
    "moe.n_group": ANY,
    "moe.group_score": only("max", applies=lambda _, moe: moe.n_group > 1),
    **DEEPSEEK_MOE,
}


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
    "deepseek_v2", NAME, from_hf, to_hf, holds=HOLDS, layout=Layout(shared_expert="shared_experts")
)
