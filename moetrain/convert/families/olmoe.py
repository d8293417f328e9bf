"""OLMoE (OlmoeForCausalLM): softmax top-k (``norm_topk_prob`` = renormalise), no shared
experts, MoE in every layer, and RMSNorm over the whole query / key projection (all heads
together: ``model.qk_norm`` with ``model.qk_norm_scope: projection``), which OLMoE always has; its
head size is ``hidden_size / num_attention_heads``; ``clip_qkv`` must be unset."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import only, refused_when

NAME = "OlmoeForCausalLM"
_WHOLE = (
    "{name} always normalises the whole query/key projection (all heads together): needs "
    "model.qk_norm=true and model.qk_norm_scope=projection"
)
HOLDS = {
    "model.head_dim": refused_when(
        lambda m, _: m.attention_head_dim * m.n_heads != m.d_model,
        "{name}'s head size is hidden_size / num_attention_heads (model.d_model={model.d_model} "
        "/ model.n_heads={model.n_heads}); leave it null",
    ),
    "model.qk_norm": only(True, why=_WHOLE),
    "model.qk_norm_scope": only("projection", why=_WHOLE),
}


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


FAMILY = Family("olmoe", NAME, from_hf, to_hf, holds=HOLDS)
