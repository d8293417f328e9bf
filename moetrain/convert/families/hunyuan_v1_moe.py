"""Hunyuan-A13B (HunYuanMoEV1ForCausalLM): Llama's attention (``attention_bias`` on all four
projections or none) with a learned per-head query/key RMSNorm after RoPE
(``self_attn.query_layernorm`` / ``key_layernorm``: ``model.qk_norm`` with
``model.qk_norm_position: after_rope``), RoPE plain or NTK-alpha scaled (``rope_type`` dynamic
with ``alpha``: a fixed stretch of the base, ``theta * alpha ** (head_dim / (head_dim - 2))``,
which an import folds into ``model.rope_theta``: the same frequencies; an export writes that
base as plain RoPE); MoE in every layer: softmax top-k, renormalised (the router
``mlp.gate.wg``), experts and one ungated shared MLP (``mlp.shared_mlp``) all of
``intermediate_size``."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, MoEConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ATTENTION_BIAS, only, refused_when
from moetrain.convert.families.layout import Layout

NAME = "HunYuanMoEV1ForCausalLM"
HOLDS = {
    **ATTENTION_BIAS,
    "model.qk_norm": only(True),
    "model.qk_norm_position": only("after_rope"),
    "moe.renormalize": only(True),
    "moe.num_shared_experts": only(1, why="{name} always has one ungated shared MLP; must be 1"),
    "moe.shared_expert_hidden": refused_when(
        lambda _, moe: moe.shared_hidden != moe.expert_hidden,
        "{name}'s shared MLP is the experts' size (intermediate_size); must be null or "
        "moe.expert_hidden={moe.expert_hidden}",
    ),
}
LAYOUT = Layout(
    router="gate.wg",
    shared_expert="shared_mlp",
    renames={
        "self_attn.q_norm": "self_attn.query_layernorm",
        "self_attn.k_norm": "self_attn.key_layernorm",
    },
)


def _per_layer(hf: Any, key: str) -> int:
    """``hf.<key>``, an int or a list of one value per layer (the same in every layer)."""
    value = getattr(hf, key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"{key}: moetrain has the same value in every layer; got {value}")
        value = value[0]
    return int(value)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return dict(
        hf_config.hf_common(cfg),
        intermediate_size=moe.expert_hidden,
        num_experts=moe.num_experts,
        moe_topk=moe.top_k,
        attention_bias=model.qkv_bias,
        # as released: the keys serving engines (vLLM) read
        use_qk_norm=True,
        use_mixed_mlp_moe=True,
        num_shared_expert=1,
        moe_intermediate_size=moe.expert_hidden,
        use_cla=False,
    )


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_dropout(hf)
    for key in ("use_cla", "mlp_bias"):
        if get(key, False):
            raise ConfigError(f"{key}: {NAME}'s class does not compute it; got {get(key, None)}")
    rope = dict(get("rope_parameters", None) or {})
    if rope.get("rope_type") == "dynamic" and rope.get("alpha"):
        hd = get("head_dim", None) or hf.hidden_size // hf.num_attention_heads
        theta = float(rope["rope_theta"]) * float(rope["alpha"]) ** (hd / (hd - 2))
        hf = hf_config.WithRope(hf, {"rope_type": "default", "rope_theta": theta})
    model = hf_config.model_from_hf(hf)
    moe = MoEConfig(top_k=_per_layer(hf, "moe_topk"), aux_loss_coef=0.0, z_loss_coef=0.0)
    hf_config.refuse_partial_rotary(model, NAME)
    model.qkv_bias = model.o_bias = bool(get("attention_bias", False))
    model.qk_norm, model.qk_norm_position = True, "after_rope"
    moe.num_experts = _per_layer(hf, "num_experts")
    moe.expert_hidden = hf.intermediate_size
    moe.num_shared_experts, moe.renormalize = 1, True
    return hf_config.finish(model, moe)


FAMILY = Family("hunyuan_v1_moe", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
