"""Grouped-query attention's keys and rules (``model.attention: gqa``, the default): query heads
``model.n_heads`` sharing ``model.n_kv_heads`` key/value heads of ``model.head_dim`` dims, and
its options. Its per-layer variants (sliding windows, chunks, NoPE and the query temperature)
are the layer plan's (:mod:`moetrain.config.layer_plan`); its module is
:mod:`moetrain.model.mixers.gqa`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from moetrain.config.checks import require
from moetrain.config.mixers.base import MixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, above, between

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig


@dataclass
class GQAKeys:
    """Grouped-query attention's own ``model`` keys."""

    # default d_model // n_heads
    head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # RMSNorm on queries and keys (Qwen3-MoE, GLM-4-MoE, OLMoE)
    qk_norm: bool = field(default=False, metadata=FUNCTION)
    # what that norm normalises: "head" (each head's vector; Qwen3-MoE, GLM-4-MoE) or
    # "projection" (the whole query / key projection, all heads together; OLMoE)
    qk_norm_scope: Literal["head", "projection"] = field(default="head", metadata=FUNCTION)
    # where a per-head norm applies: "before_rope" (Qwen3-MoE, GLM-4-MoE) or "after_rope" (on
    # the rotated heads; Hunyuan-A13B's query_layernorm / key_layernorm)
    qk_norm_position: Literal["before_rope", "after_rope"] = field(
        default="before_rope", metadata=FUNCTION
    )
    # biases on the query / key / value projections (Qwen2, Qwen2-MoE)
    qkv_bias: bool = field(default=False, metadata=FUNCTION)
    # a bias on attention's output projection (gpt-oss, Phi-3.5-MoE)
    o_bias: bool = field(default=False, metadata=FUNCTION)
    # attention sinks (gpt-oss): a learned logit per query head, layers.<i>.attn.sinks (H,),
    # added to every softmax's denominator (a key column that carries no value)
    attention_sinks: bool = field(default=False, metadata=FUNCTION)
    # the fraction of each head's dims RoPE rotates (its first head_dim * factor dims, even;
    # GLM-4.5's 0.5); the others carry no position
    partial_rotary_factor: float = field(
        default=1.0, metadata=between(0, 1, low_open=True) | FUNCTION
    )
    # the softmax scale (Granite-MoE's attention_multiplier); None = 1 / sqrt(head_dim)
    attention_scale: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # a weightless RMSNorm (eps norm_eps) over each query and key head after RoPE, on the layers
    # with RoPE only (Llama 4's use_qk_norm)
    qk_norm_after_rope: bool = field(default=False, metadata=FUNCTION)
    # a sigmoid gate on each head's output, elementwise, computed by the query projection
    # (Qwen3-Next's and Qwen3.5's gated attention: wq gives per head [query | gate])
    attention_output_gate: bool = field(default=False, metadata=FUNCTION)
    # every value is multiplied by this before attention (MiMo-V2-Flash's attention_value_scale)
    attention_value_scale: float = field(default=1.0, metadata=above(0) | FUNCTION)
    # the key/value heads of the sliding_attention layers (MiMo-V2-Flash's twice those of the
    # full ones); None: n_kv_heads
    sliding_n_kv_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the RoPE theta of the sliding_attention layers (the tables otherwise the model's, same
    # scaling; MiMo-V2-Flash's 10000 beside 5e6); None: rope_theta
    sliding_rope_theta: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # which layers have model.attention_sinks: "all" (gpt-oss) or "sliding" (the
    # sliding_attention layers only; MiMo-V2-Flash)
    attention_sinks_layers: Literal["all", "sliding"] = field(default="all", metadata=FUNCTION)


SLIDING_KEYS = ("sliding_n_kv_heads", "sliding_rope_theta")


class GQA(MixerKind):
    """Grouped-query attention (with its local variants)."""

    name = "gqa"
    keys = (
        "head_dim",
        "qk_norm",
        "qk_norm_position",
        "qkv_bias",
        "o_bias",
        "attention_sinks",
        "partial_rotary_factor",
        "attention_scale",
        "qk_norm_after_rope",
        "attention_output_gate",
        "v_head_dim",
        "attention_value_scale",
        *SLIDING_KEYS,
        "attention_sinks_layers",
    )

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        if model.head_dim is None:
            require(
                model.d_model % model.n_heads == 0,
                "model.n_heads",
                f"must divide model.d_model={model.d_model} (or set model.head_dim); "
                f"got {model.n_heads}",
            )
        if model.qk_norm_position == "after_rope":
            require(
                model.qk_norm and model.qk_norm_scope == "head",
                "model.qk_norm_position",
                "after_rope normalises each rotated head: needs model.qk_norm=true and "
                f"model.qk_norm_scope=head; got {model.qk_norm} / {model.qk_norm_scope}",
            )
        hd, rope = cls.head_dim(model), cls.rope_dim(model)
        require(hd % 2 == 0, "model.head_dim", f"must be even for rotary embeddings; got {hd}")
        require(
            rope > 0 and rope % 2 == 0,
            "model.partial_rotary_factor",
            f"must rotate an even number of dims, at least 2, of the {hd} of a head; "
            f"{model.partial_rotary_factor:g} rotates {rope}",
        )
        for key in ("n_kv_heads", "sliding_n_kv_heads"):
            heads = getattr(model, key)
            require(
                heads is None or model.n_heads % heads == 0,
                f"model.{key}",
                f"must divide model.n_heads={model.n_heads}; got {heads}",
            )
        sliding = any(s.window is not None for s in specs)
        for key in SLIDING_KEYS:
            require(
                getattr(model, key) is None or sliding,
                f"model.{key}",
                "applies to the sliding_attention layers: model.layer_types has none",
            )
        require(
            model.sliding_rope_theta is None or model.rope_scaling != "longrope",
            "model.sliding_rope_theta",
            "takes its tables from the short factors only: not with rope_scaling longrope",
        )
        require(
            not model.attention_output_gate or cls.v_dim(model) == hd,
            "model.v_head_dim",
            f"an output gate gates whole heads of model.head_dim={hd}: must equal it",
        )
        require(
            model.attention_sinks or model.attention_sinks_layers == "all",
            "model.attention_sinks_layers",
            "says which layers have sinks: needs model.attention_sinks=true",
        )

    @classmethod
    def kv_heads(cls, model: ModelConfig, spec: MixerSpec) -> int:
        """The key/value heads of a layer with ``spec``."""
        sliding = spec.window is not None and model.sliding_n_kv_heads is not None
        return model.sliding_n_kv_heads if sliding else model.n_kv_heads

    @classmethod
    def v_dim(cls, model: ModelConfig) -> int:
        """The dims of a value head (``model.v_head_dim``, else the query/key head's)."""
        return model.v_head_dim if model.v_head_dim is not None else cls.head_dim(model)

    @classmethod
    def has_sinks(cls, model: ModelConfig, spec: MixerSpec) -> bool:
        """Whether a layer with ``spec`` has attention sinks."""
        scope = model.attention_sinks_layers == "all" or spec.window is not None
        return model.attention_sinks and scope

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        """``model.head_dim``, or ``d_model // n_heads`` when it is not set."""
        return model.head_dim if model.head_dim is not None else model.d_model // model.n_heads

    @classmethod
    def rope_dim(cls, model: ModelConfig) -> int:
        return int(cls.head_dim(model) * model.partial_rotary_factor)

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """The query heads; key/value heads are repeated where they do not split."""
        return (("model.n_heads", model.n_heads),)
