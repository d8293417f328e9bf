"""Qwen2-MoE (Qwen2MoeForCausalLM): softmax top-k (``norm_topk_prob`` = renormalise), one
shared expert behind a sigmoid gate, any dense/MoE placement (``mlp_only_layers``), no q/k norm.
Its q/k/v projections carry biases (``model.qkv_bias``; written as zeros without it). A model
without a shared expert (an upcycled Qwen2, say) is written with
``shared_expert_intermediate_size: 0``, a shared expert of hidden size 0 that transformers
computes as zeros: its tensors empty, its gate zeros (``Layout.shared_expert_always``)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import free, only
from moetrain.convert.families.layout import Layout

NAME = "Qwen2MoeForCausalLM"
# any dense/MoE placement (Qwen3-MoE's too)
PLACEMENT = free("moe.first_k_dense", "moe.moe_every")
HOLDS = {
    **free("model.qkv_bias", "moe.num_shared_experts"),
    "moe.shared_expert_gate": only(True, applies=lambda _, moe: moe.num_shared_experts > 0),
    **PLACEMENT,
}


def qwen_moe_hf(cfg: Config) -> dict[str, Any]:
    """The fields Qwen2-MoE and Qwen3-MoE share."""
    return dict(
        hf_config.hf_common(cfg),
        intermediate_size=cfg.model.dense_hidden,
        moe_intermediate_size=cfg.moe.expert_hidden,
        num_experts=cfg.moe.num_experts,
        norm_topk_prob=cfg.moe.renormalize,
        decoder_sparse_step=1,
        mlp_only_layers=hf_config.dense_layers(cfg),
        use_sliding_window=False,
    )


def qwen_moe_from_hf(hf: Any) -> tuple[ModelConfig, MoEConfig]:
    """The model and MoE sections Qwen2-MoE and Qwen3-MoE share (their placement included)."""
    if getattr(hf, "use_sliding_window", False):
        raise ConfigError("use_sliding_window: moetrain attends to the whole context")
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    moe.num_experts, moe.expert_hidden = hf.num_experts, hf.moe_intermediate_size
    moe.renormalize = bool(getattr(hf, "norm_topk_prob", False))
    dense, step = getattr(hf, "mlp_only_layers", None) or [], getattr(hf, "decoder_sparse_step", 1)
    n = model.n_layers
    moe_layers = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    moe.first_k_dense, moe.moe_every = hf_config.placement(moe_layers, n)
    return model, moe


def to_hf(cfg: Config) -> dict[str, Any]:
    shared = cfg.moe.shared_hidden if cfg.moe.num_shared_experts else 0
    return dict(qwen_moe_hf(cfg), shared_expert_intermediate_size=shared, qkv_bias=True)


def from_hf(hf: Any) -> Config:
    model, moe = qwen_moe_from_hf(hf)
    model.qkv_bias = bool(getattr(hf, "qkv_bias", True))
    shared = hf.shared_expert_intermediate_size  # 0: none
    moe.num_shared_experts, moe.shared_expert_gate = int(shared > 0), shared > 0
    moe.shared_expert_hidden = shared or None
    return hf_config.finish(model, moe)


FAMILY = Family(
    "qwen2_moe",
    NAME,
    from_hf,
    to_hf,
    holds=HOLDS,
    layout=Layout(qkv_bias_always=True, shared_expert_always=True),
)
