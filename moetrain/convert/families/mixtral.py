"""Mixtral (MixtralForCausalLM): softmax over all experts, top-k, renormalised; no shared
experts, no query/key norm, MoE in every layer. Its per-expert weights are
``block_sparse_moe.experts.<e>.{w1,w3,w2}`` (transformers v5 holds them fused, under ``mlp``)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import base, hf_config
from moetrain.convert.families.base import Family, WeightNames

NAME = "MixtralForCausalLM"


def problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    return base.found(
        base.dropless_softmax(model, moe, NAME)
        + [base.no_qk_norm(model, NAME)]
        + base.every_layer_moe(moe, NAME)
        + [
            (not moe.renormalize, "moe.renormalize", f"{NAME} renormalises the top-k weights"),
            base.no_shared_experts(moe, NAME),
        ]
    )


def to_hf(cfg: Config) -> dict[str, Any]:
    return dict(
        hf_config.hf_common(cfg),
        intermediate_size=cfg.moe.expert_hidden,
        num_local_experts=cfg.moe.num_experts,
        router_jitter_noise=cfg.moe.jitter,
        sliding_window=None,
    )


def from_hf(hf: Any) -> Config:
    if getattr(hf, "sliding_window", None):
        raise ConfigError("sliding_window: moetrain attends to the whole context")
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    moe.num_experts, moe.expert_hidden = hf.num_local_experts, hf.intermediate_size
    return hf_config.finish(model, moe)


FAMILY = Family(
    name="mixtral",
    architecture=NAME,
    from_hf=from_hf,
    problems=problems,
    to_hf=to_hf,
    names=WeightNames(moe_block="block_sparse_moe", expert={"w1": "w1", "w3": "w3", "w2": "w2"}),
)
