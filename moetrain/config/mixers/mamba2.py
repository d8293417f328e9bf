"""Mamba-2's keys and rules (Granite 4.0-H's and Nemotron-H's recurrent layers: the layers of
type ``linear_attention`` when ``model.linear_attention`` is ``mamba2``): one input projection
to the gate z, the convolution's x, B, C and the step dt; a short causal convolution over x, B,
C; the selective state-space scan over ``mamba_num_heads`` heads of ``mamba_head_dim`` with
``mamba_n_groups`` groups of B and C of ``mamba_state_dim``; the gated RMSNorm per group and
the output projection. Its module is :mod:`moetrain.model.mixers.mamba2`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrain.config.checks import require
from moetrain.config.mixers.linear import LinearMixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, above, at_least

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig


@dataclass
class Mamba2Keys:
    """Mamba-2's own ``model`` keys (the head count and dims required with it)."""

    mamba_num_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    mamba_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the groups of B and C (head h reads group h // (mamba_num_heads / mamba_n_groups))
    mamba_n_groups: int = field(default=1, metadata=POSITIVE_INT | FUNCTION)
    mamba_state_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the width of the short causal convolution over x, B and C, and whether it has a bias
    mamba_conv_kernel: int = field(default=4, metadata=POSITIVE_INT | FUNCTION)
    mamba_conv_bias: bool = field(default=True, metadata=FUNCTION)
    # biases on the input and output projections
    mamba_proj_bias: bool = field(default=False, metadata=FUNCTION)
    # the step size dt = softplus(raw + dt_bias) clamped to [mamba_dt_min, mamba_dt_max]
    # (transformers' time_step_limit; null: no upper limit)
    mamba_dt_min: float = field(default=0.0, metadata=at_least(0) | FUNCTION)
    mamba_dt_max: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # the chunk length of the training scan (the function does not depend on it)
    mamba_chunk_size: int = field(default=256, metadata=POSITIVE_INT)


class Mamba2(LinearMixerKind):
    """Mamba-2 (the selective state-space model, Dao & Gu 2024; transformers' layout)."""

    name = "mamba2"
    keys = (
        "mamba_num_heads",
        "mamba_head_dim",
        "mamba_n_groups",
        "mamba_state_dim",
        "mamba_conv_kernel",
        "mamba_conv_bias",
        "mamba_proj_bias",
        "mamba_dt_min",
        "mamba_dt_max",
        "mamba_chunk_size",
    )
    required = ("mamba_num_heads", "mamba_head_dim", "mamba_state_dim")
    head_dim_key = "mamba_head_dim"

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        super().validate(model, specs)
        heads, groups = model.mamba_num_heads, model.mamba_n_groups
        require(
            heads % groups == 0,
            "model.mamba_n_groups",
            f"must divide model.mamba_num_heads={heads} (each group serves as many heads); "
            f"got {groups}",
        )
        high = model.mamba_dt_max
        require(
            high is None or high > model.mamba_dt_min,
            "model.mamba_dt_max",
            f"must be above model.mamba_dt_min={model.mamba_dt_min} (null: no limit); got {high}",
        )

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """The heads: a rank takes whole heads with their convolution channels, and the groups
        of B and C they read (repeated where the ranks do not split the groups)."""
        return (("model.mamba_num_heads", model.mamba_num_heads),)
