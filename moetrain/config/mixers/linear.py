"""What every linear-attention kind (``model.linear_attention``: Gated DeltaNet, Kimi Delta
Attention, Mamba-2) shares in its config rules: its layers take none of the attention layers'
per-layer options, its required keys must be set, no RoPE, and one key gives its head dims."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from moetrain.config.checks import require
from moetrain.config.mixers.base import MixerKind

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig

# the per-layer options of the layer plan a recurrent layer does not have: key, whether a spec
# asks for it
NO_ATTENTION_OPTIONS = (
    ("model.sliding_window", lambda s: s.window is not None),
    ("model.attention_chunk_size", lambda s: s.chunk is not None),
    ("model.nope_layers", lambda s: not s.rope),
    ("model.attn_temperature_floor", lambda s: s.temperature is not None),
)


class LinearMixerKind(MixerKind):
    """A linear-attention kind: ``required`` keys (set wherever it is used), ``head_dim_key``
    (a query / key head's dims)."""

    selected_by = "model.linear_attention"
    required: ClassVar[tuple[str, ...]] = ()
    head_dim_key: ClassVar[str]

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        for key, asks in NO_ATTENTION_OPTIONS:
            require(
                not any(asks(s) for s in specs),
                key,
                "names attention layers; a linear_attention layer has no window, chunks or RoPE",
            )
        for key in cls.required:
            require(
                getattr(model, key) is not None,
                f"model.{key}",
                f"must be set where layers are {cls.name} (model.linear_attention)",
            )

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        return getattr(model, cls.head_dim_key) or 0

    @classmethod
    def rope_dim(cls, model: ModelConfig) -> int:
        return 0
