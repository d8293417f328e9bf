"""Mixtral (MixtralForCausalLM): softmax over all experts, top-k, renormalised; no shared
experts, no query/key norm, MoE in every layer. Its per-expert weights are
``block_sparse_moe.experts.<e>.{w1,w3,w2}`` (transformers v5 holds them fused, under ``mlp``)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import only
from moetrain.convert.families.layout import Layout, PerExpert

NAME = "MixtralForCausalLM"
HOLDS = {"moe.renormalize": only(True)}
LAYOUT = Layout(
    moe_block="block_sparse_moe",
    experts=PerExpert({"w1": "w1", "w3": "w3", "w2": "w2"}),
    in_memory={"block_sparse_moe": "mlp"},
)


def to_hf(cfg: Config) -> dict[str, Any]:
    return hf_config.local_experts_hf(
        cfg,
        router_jitter_noise=cfg.moe.jitter,
        sliding_window=None,
    )


def from_hf(hf: Any) -> Config:
    if getattr(hf, "sliding_window", None):
        raise ConfigError("sliding_window: moetrain attends to the whole context")
    model, moe = hf_config.local_experts_from_hf(hf)
    return hf_config.finish(model, moe)


FAMILY = Family("mixtral", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
