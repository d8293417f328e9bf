"""Ling 3.0 (BailingHybridForCausalLM; inclusionAI's Ling-3.0-Flash, released as
``BailingMoeV3ForCausalLM``): hybrid layers, Kimi Delta Attention with full-rank forget and
output gates and the bounded forget gate (``model.linear_attention: kda``,
``model.kda_full_rank_gates``, ``model.kda_gate_lower_bound`` = ``kda_lower_bound`` where
``kda_safe_gate``) in the ``linear_attention`` layers and latent attention with RoPE in
adjacent pairs and a sigmoid gate per head on its output (``model.attention: mla``,
``model.rope_interleave``, ``model.mla_head_gate``) in the others, released the last of every
``layer_group_size`` (6: five KDA layers to one) latent attention; DeepSeek-V3's MoE (sigmoid
scores with a selection bias, group-limited routing by each group's two best experts,
``norm_topk_prob``, ``routed_scaling_factor``, ungated shared experts, the first
``first_k_dense_replace`` layers dense).

Weights (the released files, as vLLM's Ling 3.0 model reads them; transformers 5.25's
conversion mapping reads them too): the embedding ``model.word_embeddings``, the mixers under
``attention.`` (latent attention's output projection ``attention.dense``, KDA's
``attention.o_proj``; KDA's ``attention.{q,k,v}_conv1d`` apart, ``f_proj``, ``dt_bias`` and
``A_log`` (H,) beside the projections), per-expert ``mlp.experts.<e>.{gate,up,down}_proj``,
the router ``mlp.gate`` with its selection bias ``mlp.gate.expert_bias``,
``mlp.shared_experts``. transformers v5 holds them as ``model.embed_tokens``, ``self_attn.``,
``self_attn.o_proj``, the convolutions joined (``self_attn.conv1d``), the forget gate's under
``self_attn.forget_gate.``, the experts fused and ``gate.e_score_correction_bias``; its
``save_pretrained`` writes KDA's output projection as ``attention.dense`` too (its mapping
run backwards): each is read where a source has it.

The multi-token-prediction layers (``num_nextn_predict_layers``) are moetrain's
``model.mtp_depth`` modules, after the decoder layers as DeepSeek-V3's are
(``model.layers.<n>.``: ``enorm``, ``hnorm``, ``eh_proj``, a latent-attention decoder layer
with an MoE, its norm before the shared head ``final_layernorm``; no copies of the embedding
and head), the layout vLLM's Ling 3.0 model reads; transformers' class does not load them.

Released flags moetrain does not compute are refused by key: the clamped SwiGLU
(``expert_swiglu_limit_list`` / ``share_expert_swiglu_limit_list`` other than zeros), an
element-wise attention gate, low-rank KDA gates (``no_kda_lora`` false), shared experts sized
otherwise than the experts (``moe_shared_expert_intermediate_size``), biases, a router other
than sigmoid."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.layer_plan import FULL, LINEAR, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import DEEPSEEK_MOE, SIGMOID_GROUPS, mla_from_hf, mla_hf
from moetrain.convert.families.holds import LATENT_ATTENTION, free, only, refused_when
from moetrain.convert.families.kimi_linear import AsDeepSeek
from moetrain.convert.families.layout import Layout, MtpNames

NAME = "BailingHybridForCausalLM"
RELEASED = "BailingMoeV3ForCausalLM"  # config.json's class in the released files (vLLM's)
FORGET_GATE = ("f_proj", "dt_bias", "A_log")


def _not_hybrid(model: ModelConfig, _: Any) -> bool:
    return any(t not in (LINEAR, FULL) for t in layer_types(model))


HOLDS = {
    **LATENT_ATTENTION,
    "model.layer_types": refused_when(
        _not_hybrid, "{name} has Kimi Delta Attention or latent attention in every layer"
    ),
    "model.linear_attention": only(
        "kda",
        applies=lambda m, _: LINEAR in layer_types(m),
        why="{name} has Kimi Delta Attention in its linear layers; must be kda",
    ),
    "model.kda_full_rank_gates": only(
        True,
        applies=lambda m, _: LINEAR in layer_types(m),
        why="{name}'s Kimi Delta Attention gates are full-rank projections; must be true",
    ),
    "model.linear_num_heads": refused_when(
        lambda m, _: LINEAR in layer_types(m) and m.linear_num_heads != m.n_heads,
        "{name}'s Kimi Delta Attention has the attention's heads; must be "
        "model.n_heads={model.n_heads}",
    ),
    "model.mla_head_gate": only(
        True, why="{name} gates its latent attention's output per head; must be true"
    ),
    "model.rope_interleave": only(
        True, why="{name} rotates adjacent pairs in its latent attention; must be true"
    ),
    **free("model.full_attention_interval", "model.kda_gate_lower_bound"),
    **SIGMOID_GROUPS,
    **DEEPSEEK_MOE,
}
# the files' names for the mixers' modules and memory's (the first rule that matches applies:
# the output projection and the forget gate's before the module, where memory's and
# transformers' saves' rules override them in place)
_RENAMES = {
    "self_attn.o_proj": "attention.o_proj",
    **{f"self_attn.{p}": f"attention.{p}" for p in FORGET_GATE},
    "self_attn": "attention",
}
_IN_MEMORY = {
    "self_attn.o_proj": "self_attn.o_proj",
    **{f"self_attn.{p}": f"self_attn.forget_gate.{p}" for p in FORGET_GATE},
    "self_attn": "self_attn",
}
LAYOUT = Layout(
    embed="word_embeddings",
    shared_expert="shared_experts",
    selection_bias="gate.expert_bias",
    renames=_RENAMES,
    mixer_renames={"mla": {"self_attn.o_proj": "attention.dense"}},
    saved_renames={"self_attn.o_proj": "attention.dense"},  # (KDA's too in transformers' saves)
    mtp=MtpNames(head_norm="final_layernorm", embed_copy=None, head_copy=None),
    in_memory={
        "word_embeddings": "embed_tokens",
        "gate.expert_bias": "gate.e_score_correction_bias",
    },
    in_memory_renames=_IN_MEMORY,
    in_memory_joined={"self_attn.conv1d": tuple(f"self_attn.{p}_conv1d" for p in "qkv")},
)


def _group_size(types: list[str]) -> int:
    """``layer_group_size`` of a layer pattern: the released rule's (the last layer of every
    group latent attention) where it is one, else the number of layers (``layer_types``, which
    transformers reads, says the pattern)."""
    n = len(types)
    for k in range(1, n + 1):
        if types == [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]:
            return k
    return n


def to_hf(cfg: Config) -> dict[str, Any]:
    """Ling 3.0's config.json fields (transformers' names; the routing keys vLLM reads as
    released)."""
    model, moe = cfg.model, cfg.moe
    fields = mla_hf(cfg)
    for deepseek in ("n_routed_experts", "n_shared_experts", "n_group", "moe_layer_freq"):
        fields.pop(deepseek)
    types = layer_types(model)
    linear = LINEAR in types
    return dict(
        fields,
        num_experts=moe.num_experts,
        num_shared_experts=moe.num_shared_experts,
        num_expert_group=moe.n_group,
        moe_renormalize=moe.renormalize,
        num_nextn_predict_layers=model.mtp_depth,
        layer_types=types,
        layer_group_size=_group_size(types),
        mlp_layer_types=["sparse" if moe.is_moe_layer(i) else "dense" for i in range(len(types))],
        head_dim=model.linear_head_dim if linear else model.qk_rope_head_dim,
        short_conv_kernel_size=model.linear_conv_kernel_dim if linear else 4,
        kda_safe_gate=model.kda_gate_lower_bound is not None,
        kda_lower_bound=-5.0 if model.kda_gate_lower_bound is None else model.kda_gate_lower_bound,
        no_kda_lora=True,
        gated_attention_proj_granularity_type="head_wise",
        rope_interleave=True,
        score_function="sigmoid",
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_router_enable_expert_bias=True,
        # no token ids but the tokenizer's (an export's; the class's defaults are the release's)
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _refuse_released_flags(hf: Any) -> None:
    """ConfigError naming the first released flag whose computation moetrain does not have."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        limits = [v for v in (get(key) or []) if v]
        if limits:
            raise ConfigError(
                f"{key}: moetrain's SwiGLU is not clamped; {NAME} clamps it at {limits[0]} "
                "here (only zeros, no clamping, convert)"
            )
    fixed = {
        "gated_attention_proj_granularity_type": (None, "head_wise"),
        "no_kda_lora": (None, True),
        "rope_interleave": (None, True),
        "use_qkv_bias": (None, False),
        "use_bias": (None, False),
        "score_function": (None, "sigmoid"),
        "scoring_func": (None, "sigmoid"),
        "moe_router_enable_expert_bias": (None, True),
    }
    for key, allowed in fixed.items():
        if get(key) not in allowed:
            raise ConfigError(f"{key}: {NAME} computes {allowed[1]!r} only; got {get(key)!r}")
    shared = get("moe_shared_expert_intermediate_size")
    if shared is not None and shared != hf.moe_intermediate_size:
        raise ConfigError(
            f"moe_shared_expert_intermediate_size: {NAME} sizes each shared expert as the "
            f"experts (moe_intermediate_size={hf.moe_intermediate_size}); got {shared}"
        )


def from_hf(hf: Any) -> Config:
    _refuse_released_flags(hf)
    hf_config.refuse_attention_dropout(hf)
    mlp = list(getattr(hf, "mlp_layer_types", None) or [])
    first = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    if set(mlp[first:]) - {"sparse"}:
        raise ConfigError(f"mlp_layer_types: moetrain makes the first layers dense; got {mlp}")
    model, moe = mla_from_hf(AsDeepSeek(hf, first))
    types = list(getattr(hf, "layer_types", None) or [])
    if len(types) != model.n_layers or set(types) - {LINEAR, FULL}:
        raise ConfigError(f"layer_types: {NAME} needs {LINEAR} or {FULL} per layer; got {types}")
    model.layer_types, model.rope_interleave, model.mla_head_gate = types, True, True
    if LINEAR in types:
        model.linear_attention, model.kda_full_rank_gates = "kda", True
        for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
            setattr(model, key, hf_config.hf_number(hf, key, NAME, integer=True, positive=True))
        if getattr(hf, "kda_safe_gate", True):
            model.kda_gate_lower_bound = float(hf.kda_lower_bound)
    moe.score_func, moe.renormalize = "sigmoid", bool(getattr(hf, "norm_topk_prob", True))
    return hf_config.finish(model, moe)


FAMILY = Family(
    "bailing_hybrid",
    NAME,
    from_hf,
    to_hf,
    holds=HOLDS,
    layout=LAYOUT,
    released_architecture=RELEASED,
)
