"""The model of a ZeRO-3 run, partitioned as it is built (:func:`moetrain.parallel.zero3.
build_partitioned`): no rank ever holds the whole model. Its weights are the model's own random
init, drawn unit by unit in the order of a whole-model init (``checkpoint.init_from`` is refused
at stage 3 by :func:`moetrain.config.layout.check_zero3`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetrain.config import Config
from moetrain.model.transformer import Transformer
from moetrain.parallel.apply import apply_parallelism
from moetrain.parallel.topology import Topology
from moetrain.parallel.zero3 import build_partitioned


def build_zero3_model(
    cfg: Config,
    topology: Topology,
    ds_config: dict[str, Any],
    local_experts: tuple[int, int] | None,
) -> Transformer:
    """The run's model with parallelism applied and every parameter a ZeRO-3 partition, its
    weights those of a whole-model build with the same seed."""
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe, local_experts=local_experts)
    apply_parallelism(model, cfg.parallel, topology)

    def fill(name: str, unit: nn.Module) -> None:  # this unit's share of init_weights
        for sub, module in unit.named_modules(prefix=name):
            model.init_module(sub, module)

    build_partitioned(model, topology.device, ds_config, fill)
    model.reset_rope()
    return model
