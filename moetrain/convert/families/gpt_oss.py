"""gpt-oss (GptOssForCausalLM; gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases
on all four projections (``attention_bias``: ``model.qkv_bias`` and ``model.o_bias``), a
learned sink logit per head (``self_attn.sinks``: ``model.attention_sinks``), sliding-window
and full layers (``layer_types``, ``sliding_window``: ``model.layer_types``,
``model.sliding_window``), YaRN RoPE without truncation (``model.rope_truncate: false``); MoE
in every layer, a router with a bias (``mlp.router.weight`` / ``.bias``: ``moe.router_bias``)
taking top-k on its logits and softmax over the k (``moe.topk_before_score``), experts with
biases (``moe.expert_biases``) and the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g *
sigmoid(alpha * g)``, ``g = min(gate, l)`` (``swiglu_alpha``, ``swiglu_limit``:
``moe.activation: clamped_swiglu``). Its files hold each layer's experts fused, gate and up
interleaved (``Layout.experts``, :class:`~.layout.Stacked`: ``mlp.experts.gate_up_proj`` (E, D, 2F),
``gate_up_proj_bias`` (E, 2F), ``down_proj`` (E, F, D), ``down_proj_bias`` (E, D)). The
released checkpoints are MXFP4-quantized (refused: dequantize them first)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ATTENTION_BIAS, free, only
from moetrain.convert.families.layout import Layout, Stacked

NAME = "GptOssForCausalLM"
HOLDS = {
    **ATTENTION_BIAS,
    "model.attention_sinks": only(True),
    **free("model.sliding_window"),
    "moe.topk_before_score": only(True),
    "moe.router_bias": only(True),
    "moe.expert_biases": only(True),
    "moe.activation": only("clamped_swiglu"),
}
LAYOUT = Layout(router="router", experts=Stacked(interleaved=True))


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return hf_config.local_experts_hf(
        cfg,
        attention_bias=model.qkv_bias,
        sliding_window=model.sliding_window,
        layer_types=hf_config.layer_types(model),
        swiglu_alpha=moe.swiglu_alpha,
        swiglu_limit=moe.swiglu_limit,
        hidden_act="silu",
    )


def from_hf(hf: Any) -> Config:
    hf_config.refuse_attention_dropout(hf)
    model, moe = hf_config.local_experts_from_hf(hf)
    hf_config.refuse_partial_rotary(model, NAME)
    bias = bool(getattr(hf, "attention_bias", True))
    model.qkv_bias = model.o_bias = bias
    model.attention_sinks = True
    hf_config.windows_from_hf(hf, model)
    moe.score_func, moe.topk_before_score = "softmax", True
    moe.router_bias = moe.expert_biases = True
    moe.activation = "clamped_swiglu"
    moe.swiglu_alpha, moe.swiglu_limit = float(hf.swiglu_alpha), float(hf.swiglu_limit)
    return hf_config.finish(model, moe)


FAMILY = Family("gpt_oss", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
