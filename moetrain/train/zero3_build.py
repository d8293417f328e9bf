"""The model of a ZeRO-3 run, partitioned as it is built (:func:`moetrain.parallel.zero3.
build_partitioned`): no rank ever holds the whole model, whether its weights are the model's
own random init or a ``checkpoint.init_from`` source's, streamed one unit at a time."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetrain.config import Config
from moetrain.init_from.source import InitSource
from moetrain.model.transformer import Transformer
from moetrain.parallel.apply import apply_parallelism
from moetrain.parallel.topology import Topology
from moetrain.parallel.zero3 import build_partitioned


def build_zero3_model(
    cfg: Config,
    topology: Topology,
    ds_config: dict[str, Any],
    init: InitSource | None,
    local_experts: tuple[int, int] | None,
) -> Transformer:
    """The run's model with parallelism applied and every parameter a ZeRO-3 partition, its
    weights those of a whole-model build with the same seed (or ``init``'s)."""
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe, local_experts=local_experts)
    apply_parallelism(model, cfg.parallel, topology)
    if init is None:
        fill = _random_init(model)
    else:
        from moetrain.init_from.streamed import unit_filler

        fill = unit_filler(cfg, init, local_experts)
    build_partitioned(model, topology.device, ds_config, fill)
    model.reset_rope()
    return model


def _random_init(model: Transformer) -> Any:
    """Each unit's share of ``model.init_weights``, drawn in the same order."""

    def fill(name: str, unit: nn.Module) -> None:
        for sub, module in unit.named_modules(prefix=name):
            model.init_module(sub, module)

    return fill
