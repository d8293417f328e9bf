"""OLMoE (OlmoeForCausalLM): softmax top-k (``norm_topk_prob`` = renormalise), no shared
experts, MoE in every layer, and RMSNorm over the whole query / key projection (all heads
together: ``model.qk_norm`` with ``model.qk_norm_scope: projection``), which OLMoE always has; its
head size is ``hidden_size / num_attention_heads``; ``clip_qkv`` must be unset."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import base, hf_config
from moetrain.convert.families.base import Family

NAME = "OlmoeForCausalLM"


def problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    return base.found(
        base.dropless_softmax(model, moe, NAME)
        + [
            (
                not model.qk_norm or model.qk_norm_scope != "projection",
                "model.qk_norm_scope" if model.qk_norm else "model.qk_norm",
                f"{NAME} always normalises the whole query/key projection (all heads together): "
                "needs model.qk_norm=true and model.qk_norm_scope=projection",
            ),
            (
                model.attention_head_dim * model.n_heads != model.d_model,
                "model.head_dim",
                f"{NAME}'s head size is hidden_size / num_attention_heads "
                f"= {model.d_model // model.n_heads}",
            ),
        ]
        + base.every_layer_moe(moe, NAME)
        + [base.no_shared_experts(moe, NAME)]
    )


def to_hf(cfg: Config) -> dict[str, Any]:
    fields = hf_config.hf_common(cfg)
    del fields["head_dim"]  # OLMoE derives it: hidden_size / num_attention_heads
    return dict(
        fields,
        intermediate_size=cfg.moe.expert_hidden,
        num_experts=cfg.moe.num_experts,
        norm_topk_prob=cfg.moe.renormalize,
        clip_qkv=None,
        attention_bias=False,
    )


def from_hf(hf: Any) -> Config:
    if getattr(hf, "clip_qkv", None) is not None:
        raise ConfigError(f"clip_qkv: moetrain does not clip q/k/v; got {hf.clip_qkv}")
    hf_config.refuse_attention_bias(hf)
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    model.head_dim = None  # hidden_size / num_attention_heads, as OLMoE computes it
    model.qk_norm, model.qk_norm_scope = True, "projection"
    moe.num_experts, moe.expert_hidden = hf.num_experts, hf.intermediate_size
    moe.renormalize = bool(getattr(hf, "norm_topk_prob", False))
    return hf_config.finish(model, moe)


FAMILY = Family(name="olmoe", architecture=NAME, from_hf=from_hf, problems=problems, to_hf=to_hf)
