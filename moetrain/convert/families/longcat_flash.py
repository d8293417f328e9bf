"""LongCat-Flash (LongcatFlashForCausalLM; Meituan's LongCat-Flash-Chat / -Thinking): each
decoder layer holds two sublayers, each an attention and a dense FFN, and one shortcut MoE that
reads the first sublayer's FFN input and joins the stream after the second (moetrain: two
blocks per decoder layer, ``moe.layer_ffns`` alternating moe, dense with ``moe.shortcut``);
latent attention with the query LoRA always, adjacent-pair RoPE and the LoRA scales
(``model.mla_lora_scale``); a softmax router over the routed experts and ``zero_expert_num``
zero-computation experts (``moe.zero_experts``), selection shifted by
``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``), weights not
renormalised, times ``routed_scaling_factor`` (``moe.route_scale``). The files' multi-token-
prediction layers (``model.mtp.*``), which transformers' model leaves out, are not read."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import mla_from_hf
from moetrain.convert.families.holds import LATENT_ATTENTION, free, only, refused_when
from moetrain.convert.families.layout import Layout

NAME = "LongcatFlashForCausalLM"
SUBLAYER = ("input_layernorm", "post_attention_layernorm", "self_attn")
HOLDS = {
    **LATENT_ATTENTION,
    "model.rope_interleave": only(True),
    "model.mla_lora_scale": only(True),  # (which needs model.q_lora_rank)
    **free("moe.route_scale", "moe.bias_update_rate", "moe.zero_experts"),
    "moe.renormalize": only(False),
    "moe.shortcut": only(True),
    "moe.layer_ffns": refused_when(
        lambda m, moe: moe.layer_ffns != ["moe", "dense"] * (m.n_layers // 2),
        "{name} pairs a shortcut MoE sublayer with a dense one; must alternate moe, dense",
    ),
}
# one decoder layer = two moetrain blocks: the first's dense FFN is mlps.0, its experts the
# layer's mlp; the second's dense FFN mlps.1
LAYOUT = Layout(
    mtp_unread=True,
    router="router.classifier",
    selection_bias="router.e_score_correction_bias",
    sublayers=(
        {
            **{n: f"{n}.0" for n in SUBLAYER},
            **{f"mlp.{p}": f"mlps.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
        },
        {**{n: f"{n}.1" for n in SUBLAYER}, "mlp": "mlps.1"},
    ),
)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    common = hf_config.hf_common(cfg)
    for key in ("num_hidden_layers", "num_experts_per_tok", "router_aux_loss_coef", "head_dim"):
        common.pop(key)
    return dict(
        common,
        num_layers=model.n_layers // 2,
        head_dim=model.qk_rope_head_dim,  # (the RoPE tables' width)
        ffn_hidden_size=model.dense_hidden,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        moe_topk=moe.top_k,
        n_routed_experts=moe.num_experts,
        zero_expert_num=moe.zero_experts,
        expert_ffn_hidden_size=moe.expert_hidden,
        routed_scaling_factor=moe.route_scale,
        router_bias=False,
        attention_bias=False,
        # as released: keys transformers' class does not read (it scales and routes so
        # whatever they say) and serving engines do
        norm_topk_prob=False,
        mla_scale_q_lora=True,
        mla_scale_kv_lora=True,
        zero_expert_type="identity",
    )


def from_hf(hf: Any) -> Config:
    if hf.head_dim != hf.qk_rope_head_dim:
        raise ConfigError(
            f"head_dim: {NAME} rotates head_dim channels of each query's and the shared key's "
            f"qk_rope_head_dim={hf.qk_rope_head_dim}; moetrain rotates all of them: must be "
            f"equal; got {hf.head_dim}"
        )
    model, moe = mla_from_hf(hf)
    model.rope_interleave = model.mla_lora_scale = True
    moe.score_func, moe.renormalize = "softmax", False
    moe.zero_experts = int(getattr(hf, "zero_expert_num", 0) or 0)
    if getattr(hf, "router_bias", False):
        raise ConfigError(
            f"router_bias: {NAME} holds a router bias that its forward never adds (transformers "
            "5.25 scores with the classifier's weight alone); moetrain cannot hold that model"
        )
    moe.shortcut, moe.layer_ffns = True, ["moe", "dense"] * hf.num_layers
    return hf_config.finish(model, moe)


FAMILY = Family("longcat_flash", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
