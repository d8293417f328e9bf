"""Gated DeltaNet's keys and rules (Qwen3-Next's and Qwen3.5's linear attention: the layers of
type ``linear_attention`` when ``model.linear_attention`` is ``gated_deltanet``): a short causal
convolution over q, k, v, then the gated delta rule over ``linear_num_key_heads`` query/key
heads and ``linear_num_value_heads`` value heads, a gated RMSNorm and the output projection.
Its module is :mod:`moetrain.model.mixers.gated_deltanet`. The keys are transformers'
(``Qwen3NextConfig``'s)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrain.config.checks import require
from moetrain.config.mixers.linear import LinearMixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, above

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig


@dataclass
class GatedDeltaNetKeys:
    """Gated DeltaNet's own ``model`` keys (the head counts and dims required with it)."""

    # query/key heads of the rule, and value heads (a multiple: value head h reads query/key
    # head h // (linear_num_value_heads / linear_num_key_heads))
    linear_num_key_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    linear_num_value_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    linear_key_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    linear_value_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the width of the short causal convolution over q, k and v (1: no mixing of positions)
    linear_conv_kernel_dim: int = field(default=4, metadata=POSITIVE_INT | FUNCTION)
    # beta = 2 sigmoid(b), in (0, 2): the rule's transition I - beta k k^T may have negative
    # eigenvalues (Olmo-Hybrid's linear_allow_neg_eigval); false: sigmoid(b), in (0, 1)
    linear_allow_neg_eigval: bool = field(default=False, metadata=FUNCTION)
    # the eps of the gated output norm; null: model.norm_eps (Olmo-Hybrid's is 1e-5 whatever
    # its rms_norm_eps)
    linear_norm_eps: float | None = field(default=None, metadata=above(0) | FUNCTION)


class GatedDeltaNet(LinearMixerKind):
    """Gated DeltaNet (the gated delta rule, Yang et al. 2024; Qwen3-Next's layout)."""

    name = "gated_deltanet"
    keys = (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "linear_allow_neg_eigval",
        "linear_norm_eps",
    )
    required = (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    )
    head_dim_key = "linear_key_head_dim"

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        super().validate(model, specs)
        hk, hv = model.linear_num_key_heads, model.linear_num_value_heads
        require(
            hv % hk == 0,
            "model.linear_num_value_heads",
            f"must be a multiple of model.linear_num_key_heads={hk} (each query/key head serves "
            f"as many value heads); got {hv}",
        )

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """The query/key heads and the value heads: a rank takes whole groups of a query/key
        head with its value heads, their convolution channels with them."""
        return (
            ("model.linear_num_key_heads", model.linear_num_key_heads),
            ("model.linear_num_value_heads", model.linear_num_value_heads),
        )
