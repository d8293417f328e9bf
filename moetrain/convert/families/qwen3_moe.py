"""Qwen3-MoE (Qwen3MoeForCausalLM): as Qwen2-MoE, but per-head query/key RMSNorm, no shared
expert and no q/k/v biases."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import only
from moetrain.convert.families.qwen2_moe import PLACEMENT, qwen_moe_from_hf, qwen_moe_hf

NAME = "Qwen3MoeForCausalLM"
HOLDS = {"model.qk_norm": only(True), **PLACEMENT}  # (per head: BASELINE's scope)


def to_hf(cfg: Config) -> dict[str, Any]:
    return dict(qwen_moe_hf(cfg), attention_bias=False)


def from_hf(hf: Any) -> Config:
    model, moe = qwen_moe_from_hf(hf)
    model.qk_norm = True
    hf_config.refuse_attention_bias(hf)
    return hf_config.finish(model, moe)


FAMILY = Family("qwen3_moe", NAME, from_hf, to_hf, holds=HOLDS)
