"""The optimizers moetrain builds, by ``optim.name``, and what each one tells the rest.

An :class:`OptimizerSpec` owns, for its optimizer: the parameter groups (with DeepSpeed's MoE
split, :mod:`moetrain.optim.groups`), building the torch optimizer that DeepSpeed wraps, the
names of its per-parameter state (what a checkpoint holds and resharding moves), and the
update each parameter takes with its state's bytes (for ``moetrain plan`` and ``print-config``,
:mod:`moetrain.optim.summary`). Learning-rate schedules are independent
of it (:mod:`moetrain.optim.schedule`). Adding one: docs/ARCHITECTURE.md, "Adding an optimizer".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moetrain.config import ConfigError, OptimConfig
from moetrain.optim.adamw import ADAMW
from moetrain.optim.muon import MUON
from moetrain.optim.spec import OptimizerSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (ADAMW, MUON)}


def optimizer_spec(name: str) -> OptimizerSpec:
    """The registered optimizer ``name`` (``optim.name``); ConfigError naming the key if none."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"optim.name: unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def build_optimizer(
    model: nn.Module, optim: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """``optim.name``'s torch optimizer over its parameter groups of ``model``."""
    spec = optimizer_spec(optim.name)
    return spec.build(model, spec.param_groups(model, optim), optim, device)
