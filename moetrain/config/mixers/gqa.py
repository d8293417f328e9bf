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
    # a weightless RMSNorm (eps norm_eps) over each value head (Gemma 4's v_norm)
    value_norm: bool = field(default=False, metadata=FUNCTION)
    # Gemma 4's global layers: the full_attention layers' own shape where the sliding ones
    # differ. Their head dim (null: head_dim) and key/value heads (null: n_kv_heads); with
    # global_k_eq_v one key projection whose output is also the values (before the key norm
    # and RoPE; no wv); their RoPE theta (null: rope_theta) and, with global_rope_proportion
    # p, proportional RoPE: the whole head rotated half-split with frequencies theta^(-2i/Hd)
    # for i < p * Hd / 2 and zero beyond (transformers' "proportional"; no rope_scaling)
    global_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    global_n_kv_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    global_k_eq_v: bool = field(default=False, metadata=FUNCTION)
    global_rope_theta: float | None = field(default=None, metadata=above(0) | FUNCTION)
    global_rope_proportion: float | None = field(
        default=None, metadata=between(0, 1, low_open=True) | FUNCTION
    )


GEMMA_ATTENTION_KEYS = (
    "value_norm",
    "global_head_dim",
    "global_n_kv_heads",
    "global_k_eq_v",
    "global_rope_theta",
    "global_rope_proportion",
)


def has_global_rope(model: ModelConfig) -> bool:
    """Whether the full_attention layers take RoPE tables of their own (Gemma 4's)."""
    return (
        model.global_head_dim is not None
        or model.global_rope_theta is not None
        or model.global_rope_proportion is not None
    )


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
        *GEMMA_ATTENTION_KEYS,
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
        require(
            model.n_heads % model.n_kv_heads == 0,
            "model.n_kv_heads",
            f"must divide model.n_heads={model.n_heads}; got {model.n_kv_heads}",
        )
        cls._validate_global(model)

    @classmethod
    def _validate_global(cls, model: ModelConfig) -> None:
        """Gemma 4's global-layer keys."""
        g, hd = model.global_n_kv_heads, model.global_head_dim
        require(
            g is None or model.n_heads % g == 0,
            "model.global_n_kv_heads",
            f"must divide model.n_heads={model.n_heads}; got {g}",
        )
        require(hd is None or hd % 2 == 0, "model.global_head_dim", f"must be even; got {hd}")
        if not has_global_rope(model):
            return
        require(
            model.rope_scaling == "none" and model.partial_rotary_factor == 1.0,
            "model.global_head_dim",
            "the global layers' own RoPE (global_head_dim, global_rope_theta, "
            "global_rope_proportion) takes no model.rope_scaling and no "
            "model.partial_rotary_factor",
        )
        for key in ("attention_output_gate", "rope_interleave", "qk_norm_after_rope"):
            require(
                not getattr(model, key),
                f"model.{key}",
                "is not combined with the global layers' own RoPE (global_head_dim, "
                "global_rope_theta, global_rope_proportion)",
            )

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
