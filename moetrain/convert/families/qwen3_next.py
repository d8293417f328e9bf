"""Qwen3-Next (Qwen3NextForCausalLM; Qwen3-Next-80B-A3B): hybrid layers, Gated DeltaNet
(``model.linear_attention: gated_deltanet``) in the ``linear_attention`` layers of
``layer_types`` (transformers derives them from ``full_attention_interval``: the k-th layers
full attention, the others linear) and gated attention in the others (the sigmoid output gate
in ``q_proj``'s extra half: ``model.attention_output_gate``; zero-centred per-head q/k norms;
partial rotary, 0.25 as released; biases on all four projections or none), zero-centred RMSNorm
everywhere (``model.zero_centered_norm``), Qwen2-MoE's MoE (softmax top-k, ``norm_topk_prob``,
one shared expert behind a sigmoid gate, any dense/MoE placement).

Weights: Gated DeltaNet's projections fused per query/key head (``linear_attn.in_proj_qkvz``:
each head's q, k, v, z rows; ``linear_attn.in_proj_ba``: its b, a rows), which conversion
reorders to moetrain's (Qwen3.5's) four; ``linear_attn.{conv1d, A_log, dt_bias, norm,
out_proj}``. The multi-token-prediction module of the released checkpoints (``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``, ``mtp.norm``;
vLLM reads one where config.json declares none), which transformers' model leaves out, is
``model.mtp_depth`` 1.

The pieces Qwen3.5 shares (:mod:`.qwen3_5_moe_text`, :mod:`.qwen3_5_text`) are here too.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.layer_plan import FULL, LINEAR, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ATTENTION_BIAS, free, only
from moetrain.convert.families.layout import Layout, MtpNames
from moetrain.convert.families.qwen2_moe import HOLDS as QWEN2_MOE
from moetrain.convert.families.qwen2_moe import qwen_moe_from_hf, qwen_moe_hf

NAME = "Qwen3NextForCausalLM"
LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
# what every Qwen3-Next / Qwen3.5 class holds of attention and norms
HYBRID = {
    "model.linear_attention": only(
        "gated_deltanet",
        why="{name} has Gated DeltaNet in its linear layers; must be gated_deltanet",
    ),
    **free("model.full_attention_interval", "model.partial_rotary_factor"),
    **ATTENTION_BIAS,
    "model.qk_norm": only(True),
    "model.attention_output_gate": only(True),
    "model.zero_centered_norm": only(True),
    "model.mtp_depth": only(
        0, 1, why="{name}'s files hold one multi-token-prediction module; must be 0 or 1"
    ),
}
HOLDS = {**QWEN2_MOE, **HYBRID}
# the released multi-token-prediction module's names (Qwen3.5's too)
MTP = MtpNames(
    enorm="pre_fc_norm_embedding",
    hnorm="pre_fc_norm_hidden",
    eh_proj="fc",
    head_norm="norm",
    embed_copy=None,
    head_copy=None,
    block="mtp.layers.{depth}.",
    own="mtp.",
    undeclared=1,
)


def hybrid_hf(model: ModelConfig) -> dict[str, Any]:
    """The transformers fields of the hybrid layers (every Qwen3-Next / Qwen3.5 class)."""
    fields: dict[str, Any] = {key: getattr(model, key) for key in LINEAR_KEYS}
    fields.update(layer_types=layer_types(model), attention_bias=model.qkv_bias, hidden_act="silu")
    # (these classes rotate a quarter of each head unless told otherwise)
    fields["rope_parameters"] = dict(
        hf_config.rope_parameters(model), partial_rotary_factor=model.partial_rotary_factor
    )
    return fields


def hybrid_from_hf(hf: Any, model: ModelConfig, name: str) -> None:
    """Set ``model``'s hybrid layers, gated attention and norms from ``hf`` (read from
    ``name``'s config); ConfigError naming the field moetrain cannot represent."""
    hf_config.refuse_attention_dropout(hf)
    n = model.n_layers
    types = list(getattr(hf, "layer_types", None) or [])
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ConfigError(
            f"layer_types: {name} needs {LINEAR} or {FULL} for each of the {n} layers; got {types}"
        )
    interval = [k for k in range(1, n + 1) if types == _interval(k, n)]
    if interval:
        model.full_attention_interval = interval[0]
    else:
        model.layer_types = types
    for key in LINEAR_KEYS:
        setattr(model, key, hf_config.hf_number(hf, key, name, integer=True, positive=True))
    model.qkv_bias = model.o_bias = bool(getattr(hf, "attention_bias", False))
    model.qk_norm = model.attention_output_gate = model.zero_centered_norm = True


def _interval(k: int, n: int) -> list[str]:
    return [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]


def to_hf(cfg: Config) -> dict[str, Any]:
    shared = cfg.moe.shared_hidden if cfg.moe.num_shared_experts else 0
    fields = dict(
        {k: v for k, v in qwen_moe_hf(cfg).items() if k != "use_sliding_window"},
        **hybrid_hf(cfg.model),
        shared_expert_intermediate_size=shared,
    )
    if cfg.model.mtp_depth:
        fields["num_nextn_predict_layers"] = cfg.model.mtp_depth
    return fields


def from_hf(hf: Any) -> Config:
    model, moe = qwen_moe_from_hf(hf)
    hybrid_from_hf(hf, model, NAME)
    shared = hf.shared_expert_intermediate_size  # 0: none
    moe.num_shared_experts, moe.shared_expert_gate = int(shared > 0), shared > 0
    moe.shared_expert_hidden = shared or None
    return hf_config.finish(model, moe)


LAYOUT = Layout(shared_expert_always=True, mtp=MTP, linear_fused=True)
FAMILY = Family("qwen3_next", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
