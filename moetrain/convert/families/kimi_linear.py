"""Kimi Linear (KimiLinearForCausalLM; Kimi-Linear-48B-A3B): hybrid layers, Kimi Delta Attention
(``model.linear_attention: kda``) in the ``linear_attention`` layers and latent attention
without RoPE (``model.attention: mla``, every full-attention layer in ``model.nope_layers``: the
head-shared key part is computed, never rotated) in the others, 3 to 1 as released (the
files' ``linear_attn_config``: ``kda_layers`` and ``full_attn_layers``, counted from 1);
DeepSeek-V3's MoE (sigmoid scores with the selection bias ``e_score_correction_bias``,
group-limited routing, ``moe_renormalize``, ``routed_scaling_factor``, ungated shared experts,
the first ``first_k_dense_replace`` layers dense).

Weights: per-expert ``block_sparse_moe.experts.<e>.{w1,w3,w2}`` and ``self_attn.{q,k,v}_conv1d``,
``self_attn.A_log`` stored (1, 1, H, 1); transformers v5 holds the experts fused under ``mlp``,
the convolutions joined (``self_attn.conv1d``) and ``f_a_proj``, ``f_b_proj``, ``A_log``,
``dt_bias`` under ``self_attn.forget_gate``, and its ``save_pretrained`` writes the dense
layers' ``mlp`` as ``block_sparse_moe``: each is read where a source has it."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.config.layer_plan import FULL, LINEAR, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import DEEPSEEK_MOE, SIGMOID_GROUPS, mla_from_hf, mla_hf
from moetrain.convert.families.holds import LATENT_ATTENTION, free, only, refused_when
from moetrain.convert.families.layout import Layout, PerExpert

NAME = "KimiLinearForCausalLM"
FORGET_GATE = ("f_a_proj", "f_b_proj", "A_log", "dt_bias")


def _nope_not_full(model: ModelConfig, _: MoEConfig) -> bool:
    full = [i for i, t in enumerate(layer_types(model)) if t == FULL]
    return (model.nope_layers or []) != full


HOLDS = {
    **LATENT_ATTENTION,
    "model.linear_attention": only(
        "kda", why="{name} has Kimi Delta Attention in its linear layers; must be kda"
    ),
    **free("model.full_attention_interval"),
    "model.nope_layers": refused_when(
        _nope_not_full,
        "{name}'s latent attention layers have no RoPE; must list exactly the "
        "full_attention layers",
    ),
    **SIGMOID_GROUPS,
    **DEEPSEEK_MOE,
}
LAYOUT = Layout(
    moe_block="block_sparse_moe",
    experts=PerExpert({"w1": "w1", "w3": "w3", "w2": "w2"}),
    shared_expert="shared_experts",
    selection_bias="gate.e_score_correction_bias",
    # (transformers saves the dense layers under block_sparse_moe too: its renaming backwards)
    in_memory={"block_sparse_moe": "mlp", "mlp": "block_sparse_moe"},
    columns=("self_attn.A_log",),
    in_memory_renames={f"self_attn.{p}": f"self_attn.forget_gate.{p}" for p in FORGET_GATE},
    in_memory_joined={"self_attn.conv1d": tuple(f"self_attn.{p}_conv1d" for p in "qkv")},
)


def to_hf(cfg: Config) -> dict[str, Any]:
    """Kimi Linear's config.json fields as released (its own MoE names, the layer pattern in
    ``linear_attn_config``)."""
    model, moe = cfg.model, cfg.moe
    fields = mla_hf(cfg)
    for deepseek in ("n_routed_experts", "n_shared_experts", "n_group", "num_experts_per_tok"):
        fields.pop(deepseek)
    types = layer_types(model)
    return dict(
        fields,
        num_experts=moe.num_experts,
        num_experts_per_token=moe.top_k,
        num_shared_experts=moe.num_shared_experts,
        num_expert_group=moe.n_group,
        use_grouped_topk=True,
        moe_router_activation_func="sigmoid",
        moe_renormalize=moe.renormalize,
        mla_use_nope=True,
        num_nextn_predict_layers=0,
        # no token ids but the tokenizer's (an export's; the class's defaults are the release's)
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        linear_attn_config={
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == LINEAR],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == FULL],
            "num_heads": model.linear_num_heads,
            "head_dim": model.linear_head_dim,
            "short_conv_kernel_size": model.linear_conv_kernel_dim,
        },
    )


class AsDeepSeek:
    """A Kimi Linear (or Ling 3.0) config read through DeepSeek-V3's field names."""

    def __init__(self, hf: Any, first_dense: int) -> None:
        self._hf, self.first_k_dense_replace = hf, first_dense
        self.n_routed_experts = hf.num_local_experts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    if get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"moe_router_activation_func: {NAME} routes with sigmoid")
    if get("mla_use_nope", True) is not True:
        raise ConfigError(f"mla_use_nope: {NAME}'s latent attention has no RoPE; must be true")
    if get("num_nextn_predict_layers", 0):
        raise ConfigError(f"num_nextn_predict_layers: {NAME} has no multi-token prediction")
    mlp = list(get("mlp_layer_types") or [])
    first = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    if set(mlp[first:]) - {"sparse"}:
        raise ConfigError(f"mlp_layer_types: moetrain makes the first layers dense; got {mlp}")
    hf_config.refuse_attention_dropout(hf)
    model, moe = mla_from_hf(AsDeepSeek(hf, first))
    types = list(get("layer_types") or [])
    if len(types) != model.n_layers or set(types) - {LINEAR, FULL}:
        raise ConfigError(f"layer_types: {NAME} needs {LINEAR} or {FULL} per layer; got {types}")
    model.layer_types, model.linear_attention = types, "kda"
    model.nope_layers = [i for i, t in enumerate(types) if t == FULL] or None
    if LINEAR in types:
        for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
            setattr(model, key, hf_config.hf_number(hf, key, NAME, integer=True, positive=True))
    moe.score_func, moe.renormalize = "sigmoid", bool(get("norm_topk_prob", True))
    return hf_config.finish(model, moe)


FAMILY = Family("kimi_linear", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
