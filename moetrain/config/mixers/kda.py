"""Kimi Delta Attention's keys and rules (Kimi Linear's linear attention: the layers of type
``linear_attention`` when ``model.linear_attention`` is ``kda``): a short causal convolution
over q, k, v, then the gated delta rule with a decay per key channel over ``linear_num_heads``
heads of ``linear_head_dim`` dims (keys and values alike), a sigmoid-gated RMSNorm and the
output projection. Its module is :mod:`moetrain.model.mixers.kda`. The keys are transformers'
(``KimiLinearConfig``'s); the convolution's width ``linear_conv_kernel_dim`` is the one Gated
DeltaNet declares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrain.config.checks import ConfigError, require
from moetrain.config.mixers.base import MixerKind
from moetrain.config.mixers.gated_deltanet import NO_ATTENTION_OPTIONS
from moetrain.config.ranges import FUNCTION, POSITIVE_INT

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig


@dataclass
class KDAKeys:
    """Kimi Delta Attention's own ``model`` keys (required with it)."""

    # the rule's heads (each its own query, key and value) and their dims (keys and values)
    linear_num_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    linear_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)


class KDA(MixerKind):
    """Kimi Delta Attention (Kimi Linear's layout: a per-channel forget gate from a low-rank
    projection, a sigmoid output gate from another)."""

    name = "kda"
    selected_by = "model.linear_attention"
    keys = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        for key, asks in NO_ATTENTION_OPTIONS:
            require(
                not any(asks(s) for s in specs),
                key,
                "names attention layers; a linear_attention layer has no window, chunks or RoPE",
            )
        for key in cls.keys[:2]:
            require(
                getattr(model, key) is not None,
                f"model.{key}",
                f"must be set where layers are {cls.name} (model.linear_attention)",
            )

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        """A query / key head's dims (``linear_head_dim``)."""
        return model.linear_head_dim or 0

    @classmethod
    def rope_dim(cls, model: ModelConfig) -> int:
        return 0

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        raise ConfigError(
            "parallel.sp_size: Kimi Delta Attention layers (model.linear_attention=kda) do not "
            "run under sequence parallelism yet (their heads are not exchanged); set it to 1"
        )
