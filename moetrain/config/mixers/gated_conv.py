"""The gated short convolution's keys and rules (LFM2's ``conv`` layers: the layers of type
``linear_attention`` when ``model.linear_attention`` is ``gated_conv``): one input projection
to B, C and x (d_model channels each), ``B * x`` through a causal depthwise convolution of
``gated_conv_kernel`` positions, gated by C, then the output projection. Its module is
:mod:`moetrain.model.mixers.gated_conv`. The keys are transformers' ``Lfm2MoeConfig``'s
``conv_L_cache`` and ``conv_bias``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrain.config.mixers.linear import LinearMixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT

if TYPE_CHECKING:
    from moetrain.config.model import ModelConfig


@dataclass
class GatedConvKeys:
    """The gated short convolution's own ``model`` keys."""

    # the convolution's width (positions a token sees, itself included)
    gated_conv_kernel: int = field(default=3, metadata=POSITIVE_INT | FUNCTION)
    # biases on the input projection, the convolution and the output projection (LFM2's
    # conv_bias: one switch for the three)
    gated_conv_bias: bool = field(default=False, metadata=FUNCTION)


class GatedConv(LinearMixerKind):
    """The gated short convolution (LFM2's ``ShortConv``): no heads, one channel per d_model."""

    name = "gated_conv"
    keys = ("gated_conv_kernel", "gated_conv_bias")

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        return 0

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """The channels: depthwise, each convolves on its own, so a rank takes ``1 / n`` of
        them."""
        return (("model.d_model", model.d_model),)
