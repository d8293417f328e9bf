"""The model of a ZeRO-3 run, partitioned as it is built (:func:`moetrain.parallel.zero3.
build_partitioned`): no rank ever holds the whole model. Its weights are the model's own random
init, drawn unit by unit in the order of a whole-model init, or ``checkpoint.init_from``'s.

From a source, each unit's weights are read by one rank only and reach the others through
DeepSpeed: ``deepspeed.zero.Init(module=unit)`` broadcasts every parameter from the first rank of
its partition group before it partitions it (``Init._zero_init_param``). So rank 0 reads the
unit's dense weights, the first rank of each expert-data-parallel group that group's experts;
the other ranks read nothing of the unit and fill its parameters with NaN, which the broadcast
overwrites (a DeepSpeed that stopped broadcasting would start from NaN, not from garbage).
Buffers are not broadcast: every rank reads the unit's persistent buffers (the routers' selection
biases). Each rank holds at most one unit read from the source besides its partitions; the
source's files are opened for the tensors of one unit at a time
(:mod:`moetrain.init_from.unit_reads`). A read that fails on one rank (a non-finite
tensor, an unreadable file) stops every rank with that error, named, before the broadcast.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.checkpoint.format import CheckpointError
from moetrain.config import Config
from moetrain.init_from.source import InitSource
from moetrain.init_from.unit_reads import CheckpointUnitReads, UnitReads, unit_reads
from moetrain.init_from.weights import check_filled, copy_part
from moetrain.model import param_names as pn
from moetrain.model.transformer import Transformer
from moetrain.parallel.apply import apply_parallelism
from moetrain.parallel.topology import Topology
from moetrain.parallel.zero3 import EXPERT_FAMILY, Fill, build_partitioned

_EXPERT = re.compile(rf"{pn.EXPERTS_PATTERN}\.")  # a stacked expert weight's name


def build_zero3_model(
    cfg: Config,
    topology: Topology,
    ds_config: dict[str, Any],
    local_experts: tuple[int, int] | None,
    init: InitSource | None = None,
) -> Transformer:
    """The run's model with parallelism applied and every parameter a ZeRO-3 partition, its
    weights those of a whole-model build with the same seed, or ``init``'s (fp32, rounded to
    the training dtype as at ZeRO-1/2)."""
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe, local_experts=local_experts)
    apply_parallelism(model, cfg.parallel, topology)

    def random(name: str, unit: nn.Module) -> None:  # this unit's share of init_weights
        for sub, module in unit.named_modules(prefix=name):
            model.init_module(sub, module)

    experts = local_experts or (0, cfg.moe.num_experts)
    fill = random if init is None else _source_fill(unit_reads(init, cfg, experts), topology)
    build_partitioned(model, topology.device, ds_config, fill)
    model.reset_rope()
    return model


def _reader(param: nn.Parameter) -> int:
    """The global rank whose values ``deepspeed.zero.Init`` broadcasts to ``param``'s partition
    group: the group's first (rank 0 for a dense weight, partitioned over every rank)."""
    if getattr(param, "ds_zero_placement_family", None) == EXPERT_FAMILY:
        return dist.get_global_rank(param.ds_zero_partition_process_group, 0)
    return 0


def _source_fill(reads: UnitReads | CheckpointUnitReads, topology: Topology) -> Fill:
    """The ``fill`` of :func:`~moetrain.parallel.zero3.build_partitioned` from a source (the
    module docstring)."""
    me = topology.rank

    @torch.no_grad()
    def fill(name: str, unit: nn.Module) -> None:
        targets = unit.state_dict(prefix=f"{name}.", keep_vars=True)
        params = {id(p) for p in unit.parameters()}
        mine: dict[str, torch.Tensor] = {}  # what this rank reads
        for key, t in targets.items():
            if hasattr(t, "ds_id"):  # partitioned by an earlier unit (a tied head)
                continue
            if id(t) not in params or _reader(t) == me:  # buffers: every rank
                mine[key] = t
            else:
                t.fill_(float("nan"))  # overwritten by the reader's broadcast
        dense = [k for k in mine if not _EXPERT.match(k)]
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        failure: Exception | None = None
        try:
            got = reads.read(dense, layer, len(dense) < len(mine)) if mine else {}
            check_filled(
                mine, copy_part(got, mine, f"{reads.source.path} ({name})"), reads.source.path
            )
        except Exception as err:  # noqa: BLE001 (every rank stops, this one with its error)
            failure = err
        flag = torch.tensor([failure is not None], dtype=torch.int32, device=topology.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if flag.item():
            raise CheckpointError(
                f"checkpoint.init_from={reads.source.path}: another rank failed to read {name}"
            )

    return fill
