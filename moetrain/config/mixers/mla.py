"""Multi-head latent attention's keys and rules (``model.attention: mla``; DeepSeek-V2/V3):
keys and values from a compressed latent, a rotary key shared by all heads. Its module is
:mod:`moetrain.model.mixers.mla`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrain.config.checks import require
from moetrain.config.mixers.base import MixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig


@dataclass
class MLAKeys:
    """Latent attention's own ``model`` keys (required with it, except q_lora_rank)."""

    # rank of the low-rank query path (q = up(norm(down(x)))); None = one full query projection
    q_lora_rank: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the KV latent's size
    kv_lora_rank: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # per-head query / key dims without RoPE
    qk_nope_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the rotary part of each query head and of the one key shared by all heads (even)
    qk_rope_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    v_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)


# the per-layer options of the layer plan latent attention does not have: key, whether a spec
# asks for it
_NO_LOCAL = (
    ("model.sliding_window", lambda s: s.window is not None),
    ("model.attention_chunk_size", lambda s: s.chunk is not None),
    ("model.nope_layers", lambda s: not s.rope),
    ("model.attn_temperature_floor", lambda s: s.temperature is not None),
)


class MLA(MixerKind):
    """Multi-head latent attention."""

    name = "mla"
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        for key, asks in _NO_LOCAL:
            require(
                not any(asks(s) for s in specs),
                key,
                "only applies with model.attention=gqa (latent attention layers attend to "
                "the full context with RoPE)",
            )
        for key in cls.keys[1:]:
            require(
                getattr(model, key) is not None,
                f"model.{key}",
                "must be set with model.attention=mla",
            )
        require(
            model.qk_rope_head_dim % 2 == 0,
            "model.qk_rope_head_dim",
            f"must be even for rotary embeddings; got {model.qk_rope_head_dim}",
        )
        require(
            model.n_kv_heads == model.n_heads,
            "model.n_kv_heads",
            f"must equal model.n_heads={model.n_heads} with model.attention=mla (every head has "
            f"its own keys and values, from the shared latent); got {model.n_kv_heads}",
        )

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        """A query / key head's dims: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return (model.qk_nope_head_dim or 0) + (model.qk_rope_head_dim or 0)

    @classmethod
    def rope_dim(cls, model: ModelConfig) -> int:
        return model.qk_rope_head_dim or 0

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        return (("model.n_heads", model.n_heads),)
