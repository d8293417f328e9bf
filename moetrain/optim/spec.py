"""What an optimizer tells the rest of moetrain: :class:`OptimizerSpec`, registered by name in
:mod:`moetrain.optim.registry`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetrain.config import Config, OptimConfig

if TYPE_CHECKING:
    import torch
    from torch import nn


def no_qk_clip(optim: OptimConfig) -> float:
    """An optimizer without QK-clip."""
    return 0.0


def no_step_flops(cfg: Config, gpus: int) -> int:
    """An optimizer whose step is elementwise (its FLOPs are negligible)."""
    return 0


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, as the trainer, the checkpoints and ``moetrain plan`` see it.

    - ``update_of(name, ndim, optim)``: the update rule parameter ``name`` (of ``ndim`` dims)
      takes (``adamw``, ``muon``); ``update_bytes``: each rule's state bytes per parameter.
      ``moetrain plan`` and ``print-config`` count them on the model's shapes
      (:mod:`moetrain.optim.summary`).
    - ``param_groups(model, optim)``: the groups handed to DeepSpeed; each group's dict keys
      other than ``params`` are saved with the optimizer state.
    - ``build(model, groups, optim, device)``: the torch optimizer over those groups.
    - ``state_keys(group)``: the per-parameter state tensors of a group (a saved group's dict,
      without its params), each fp32 and shaped like the parameter (like the flat partition
      under ZeRO-1/2); every group also counts its ``step``.
    - ``attach(optimizer, engine_optimizer)``: called once the DeepSpeed engine exists (its
      optimizer wraps ``optimizer``), for an optimizer that needs to know how ZeRO partitioned
      its groups; None when it does not.
    - ``qk_clip(optim)``: the QK-clip threshold (0: off); when on, the torch optimizer takes
      each step's row multipliers of the query and key projections (``set_row_scales``)
      before the step.
    - ``step_flops(cfg, gpus)``: FLOPs of one optimizer step per GPU beyond the elementwise
      (for ``moetrain plan``; 0 for an elementwise optimizer).
    """

    name: str
    update_of: Callable[[str, int, OptimConfig], str]
    update_bytes: Mapping[str, int]
    param_groups: Callable[[nn.Module, OptimConfig], list[dict[str, Any]]]
    build: Callable[
        [nn.Module, list[dict[str, Any]], OptimConfig, torch.device], torch.optim.Optimizer
    ]
    state_keys: Callable[[Mapping[str, Any]], tuple[str, ...]]
    attach: Callable[[torch.optim.Optimizer, Any], None] | None = None
    qk_clip: Callable[[OptimConfig], float] = no_qk_clip
    step_flops: Callable[[Config, int], int] = no_step_flops
