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

from moetrain.config.mixers.linear import LinearMixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, RANGE, Range

if TYPE_CHECKING:
    from moetrain.config.model import ModelConfig


@dataclass
class KDAKeys:
    """Kimi Delta Attention's own ``model`` keys (required with it)."""

    # the rule's heads (each its own query, key and value) and their dims (keys and values)
    linear_num_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    linear_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the forget gate's and the output gate's projections full rank, f_proj and g_proj
    # (D -> H K: Ling 3.0's); false: low rank through K, f_a_proj / f_b_proj and g_a_proj /
    # g_b_proj (Kimi Linear's)
    kda_full_rank_gates: bool = field(default=False, metadata=FUNCTION)
    # the bounded ("safe") forget gate g = bound * sigmoid(exp(A_log) (f + dt_bias)), in
    # (bound, 0) (Ling 3.0's kda_lower_bound, -5); null: -exp(A_log) softplus(f + dt_bias)
    kda_gate_lower_bound: float | None = field(
        default=None, metadata={RANGE: Range(high=0.0, high_open=True)} | FUNCTION
    )


class KDA(LinearMixerKind):
    """Kimi Delta Attention (Kimi Linear's layout: a per-channel forget gate from a low-rank
    projection, a sigmoid output gate from another; Ling 3.0's: both full rank, the forget
    gate bounded)."""

    name = "kda"
    keys = (
        "linear_num_heads",
        "linear_head_dim",
        "linear_conv_kernel_dim",
        "kda_full_rank_gates",
        "kda_gate_lower_bound",
    )
    required = ("linear_num_heads", "linear_head_dim")
    head_dim_key = "linear_head_dim"

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """The heads: a rank takes whole heads, their convolution channels and decays with
        them."""
        return (("model.linear_num_heads", model.linear_num_heads),)
