"""Phi-3.5-MoE (PhimoeForCausalLM; microsoft/Phi-3.5-MoE-instruct, whose config.json names it
PhiMoEForCausalLM, as exports do: vLLM registers that name): sparsemixer top-2 routing
(``moe.router_type: sparsemixer``, its mask's eps ``router_jitter_noise`` =
``moe.router_jitter_eps``; it picks two experts whatever ``num_experts_per_tok`` says),
LayerNorm with a bias everywhere (``model.norm: layernorm``, eps ``rms_norm_eps``), biases on all
four attention projections with ``attention_bias`` (``model.qkv_bias`` and ``model.o_bias``), an
LM-head bias with ``lm_head_bias`` (``model.lm_head_bias``), no shared experts, MoE in every
layer, and plain RoPE or LongRoPE.

Its LongRoPE multiplies cos and sin by ``short_mscale`` while the sequence stays within
``original_max_position_embeddings`` (``model.rope_attention_factor``; ``attention_factor`` is not
read) and by ``long_mscale`` beyond; transformers 5.25 then keeps the short factors' frequencies
(its forward recomputes them without the sequence length) where the original code takes the
long ones: ``model.rope_long_regime: short``, so the 128k context computes as transformers does.
moetrain keeps one mscale for both: a ``long_mscale`` other than ``short_mscale`` is refused (the
released model's are equal). Files name the MoE block ``block_sparse_moe`` with Mixtral's per-expert
``experts.<e>.{w1,w3,w2}`` and router ``gate`` (transformers v5: ``mlp``, ``mlp.router``).

``input_jitter_noise`` (the released 0.01) is training-time noise on the MoE block's input,
which transformers' eval and generation never apply: it is written from ``moe.jitter`` (as
Mixtral's ``router_jitter_noise``) and not read back.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ATTENTION_BIAS, free, only
from moetrain.convert.families.layout import Layout, PerExpert

NAME = "PhimoeForCausalLM"
HOLDS = {
    "model.rope_scaling": only(
        "none",
        "longrope",
        why="{name} multiplies any scaled RoPE by its short_mscale; must be none or longrope",
    ),
    "model.rope_long_regime": only(
        "short",
        applies=lambda m, _: m.rope_scaling == "longrope",
        why="{name} (transformers 5.25) keeps LongRoPE's short factors past the original "
        "context; must be short",
    ),
    **ATTENTION_BIAS,
    "model.norm": only("layernorm"),
    **free("model.lm_head_bias"),
    "moe.router_type": only("sparsemixer"),
}
LAYOUT = Layout(
    moe_block="block_sparse_moe",
    experts=PerExpert({"w1": "w1", "w3": "w3", "w2": "w2"}),
    in_memory={"block_sparse_moe": "mlp", "gate": "router"},
)


def _rope(model: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters, LongRoPE's attention factor as both mscales."""
    out = hf_config.rope_parameters(model)
    if model.rope_scaling == "longrope":
        out.pop("attention_factor", None)
        scale = model.longrope_attention_factor
        out.update(short_mscale=scale, long_mscale=scale)
    return out


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return hf_config.local_experts_hf(
        cfg,
        rope_parameters=_rope(model),
        attention_bias=model.qkv_bias,
        lm_head_bias=model.lm_head_bias,
        router_jitter_noise=moe.router_jitter_eps,
        input_jitter_noise=moe.jitter,
        sliding_window=None,
        hidden_act="silu",
    )


def _mscale(rope: dict[str, Any]) -> float | None:
    """LongRoPE's attention factor (``short_mscale``); None for plain RoPE."""
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "longrope"):
        raise ConfigError(
            f"rope_parameters.rope_type: {NAME} multiplies any scaled RoPE by short_mscale; "
            f"moetrain computes default and longrope for it; got {kind!r}"
        )
    if kind == "default":
        return None
    short, long = rope.get("short_mscale"), rope.get("long_mscale")
    if long != short:
        raise ConfigError(
            f"rope_parameters.long_mscale: moetrain keeps one LongRoPE mscale within and past "
            f"original_max_position_embeddings; must equal short_mscale={short}, got {long}"
        )
    return float(short)


def from_hf(hf: Any) -> Config:
    if hf.num_experts_per_tok != 2:
        raise ConfigError(
            f"num_experts_per_tok: {NAME}'s sparsemixer always picks 2 experts; got "
            f"{hf.num_experts_per_tok}"
        )
    model, moe = hf_config.local_experts_from_hf(hf)
    window = getattr(hf, "sliding_window", None)
    if window is not None and window < model.max_seq_len:
        raise ConfigError(
            f"sliding_window: {window} < max_position_embeddings={model.max_seq_len}; "
            "moetrain attends to the whole context"
        )
    mscale = _mscale(hf.rope_parameters or {})
    if mscale is not None:
        model.rope_attention_factor, model.rope_long_regime = mscale, "short"
    model.norm = "layernorm"
    model.qkv_bias = model.o_bias = bool(getattr(hf, "attention_bias", False))
    model.lm_head_bias = bool(getattr(hf, "lm_head_bias", False))
    moe.router_type, moe.renormalize = "sparsemixer", False
    moe.router_jitter_eps = float(hf.router_jitter_noise)
    return hf_config.finish(model, moe)


FAMILY = Family(
    "phimoe",
    NAME,
    from_hf,
    to_hf,
    holds=HOLDS,
    layout=LAYOUT,
    released_architecture="PhiMoEForCausalLM",  # the released config.json's (and vLLM's) name
)
