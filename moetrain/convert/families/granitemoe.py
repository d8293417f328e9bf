"""Granite-MoE (GraniteMoeForCausalLM; granite-3.0-1b-a400m, granite-3.1-3b-a800m): top-k on
the router logits, then softmax over the k (``moe.topk_before_score``), no shared experts, MoE
in every layer, and muP-style scalars: the embeddings times ``embedding_multiplier``, each
block's attention and MoE outputs times ``residual_multiplier``, attention's softmax scale
``attention_multiplier`` (moetrain's ``model.attention_scale``), the logits divided by
``logits_scaling`` (``model.embedding_multiplier``, ``model.residual_multiplier``,
``model.logits_scaling``). Its files hold each layer's experts fused:
``block_sparse_moe.input_linear.weight`` (E, 2F, D) = [gate; up],
``block_sparse_moe.output_linear.weight`` (E, D, F) and the router
``block_sparse_moe.router.layer.weight`` (transformers v5 renames them in memory to
``block_sparse_moe.experts.gate_up_proj`` / ``down_proj`` and ``block_sparse_moe.router``)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import base
from moetrain.convert.families.base import Family, WeightNames

NAME = "GraniteMoeForCausalLM"


def problems(model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    return base.found(
        [
            base.dropless(moe, NAME),
            (
                model.qkv_bias,
                "model.qkv_bias",
                f"{NAME}'s attention_bias puts biases on every attention projection (the "
                "output too); moetrain has q/k/v biases only: must be false",
            ),
            base.no_qk_norm(model, NAME),
            (moe.score_func != "softmax", "moe.score_func", f"{NAME} routes with softmax"),
            (
                not moe.topk_before_score,
                "moe.topk_before_score",
                f"{NAME} takes top-k on the router logits, then softmax over the k; must be true",
            ),
            (moe.route_scale != 1.0, "moe.route_scale", f"{NAME} has no route scale; must be 1.0"),
            (
                moe.bias_update_rate != 0.0,
                "moe.bias_update_rate",
                f"{NAME} has no expert bias (aux-loss-free balancing); must be 0",
            ),
            (moe.n_group != 1, "moe.n_group", f"{NAME} routes without expert groups; must be 1"),
        ]
        + base.every_layer_moe(moe, NAME)
        + [base.no_shared_experts(moe, NAME)]
    )


def attention_multiplier(model: ModelConfig) -> float:
    """transformers' ``attention_multiplier`` of ``model``: its attention scale, or
    1 / sqrt(head_dim) where it has none."""
    scale = model.attention_scale
    return model.attention_head_dim**-0.5 if scale is None else scale


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return dict(
        base.hf_common(cfg),
        intermediate_size=moe.expert_hidden,
        num_local_experts=moe.num_experts,
        embedding_multiplier=model.embedding_multiplier,
        residual_multiplier=model.residual_multiplier,
        attention_multiplier=attention_multiplier(model),
        logits_scaling=model.logits_scaling,
        attention_bias=False,
        hidden_act="silu",
    )


def _positive(hf: Any, key: str) -> float:
    value = getattr(hf, key, 1.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{key}: {NAME} needs a positive number; got {value!r}")
    return float(value)


def from_hf(hf: Any) -> Config:
    base.refuse_attention_bias(hf)
    model, moe = base.model_from_hf(hf), base.moe_from_hf(hf)
    if model.partial_rotary_factor != 1.0:
        raise ConfigError(
            f"rope_parameters.partial_rotary_factor: {NAME} rotates whole heads; got "
            f"{model.partial_rotary_factor:g}"
        )
    if getattr(hf, "shared_intermediate_size", 0):
        raise ConfigError(
            f"shared_intermediate_size: a shared expert is GraniteMoeSharedForCausalLM's; "
            f"{NAME} has none"
        )
    model.embedding_multiplier = _positive(hf, "embedding_multiplier")
    model.residual_multiplier = _positive(hf, "residual_multiplier")
    model.attention_scale = _positive(hf, "attention_multiplier")
    model.logits_scaling = _positive(hf, "logits_scaling")
    moe.num_experts, moe.expert_hidden = hf.num_local_experts, hf.intermediate_size
    moe.score_func, moe.topk_before_score = "softmax", True
    return base.finish(model, moe)


NAMES = WeightNames(
    moe_block="block_sparse_moe",
    router="router.layer",
    v5_block="block_sparse_moe",
    v5_router="router",
    fused_experts=("input_linear", "output_linear"),
)

FAMILY = Family(
    name="granitemoe",
    architecture=NAME,
    from_hf=from_hf,
    problems=problems,
    to_hf=to_hf,
    names=NAMES,
    multipliers=True,
)
