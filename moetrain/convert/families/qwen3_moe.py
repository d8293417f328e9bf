"""Qwen3-MoE (Qwen3MoeForCausalLM): as Qwen2-MoE, but per-head query/key RMSNorm, no shared
expert and no q/k/v biases."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ModelConfig, MoEConfig
from moetrain.convert.families import base, hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.qwen2_moe import qwen_moe_from_hf, qwen_moe_hf

NAME = "Qwen3MoeForCausalLM"


def problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    return base.found(
        base.dropless_softmax(model, moe, NAME)
        + [
            (not model.qk_norm, "model.qk_norm", f"{NAME} always has per-head q/k norm"),
            base.per_head_norm(model, NAME),
            base.no_shared_experts(moe, NAME),
        ]
    )


def to_hf(cfg: Config) -> dict[str, Any]:
    return dict(qwen_moe_hf(cfg), attention_bias=False)


def from_hf(hf: Any) -> Config:
    model, moe = qwen_moe_from_hf(hf)
    model.qk_norm = True
    hf_config.refuse_attention_bias(hf)
    return hf_config.finish(model, moe)


FAMILY = Family(
    name="qwen3_moe", architecture=NAME, from_hf=from_hf, problems=problems, to_hf=to_hf
)
