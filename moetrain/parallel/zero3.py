"""ZeRO-3 with expert parallelism (``parallel.zero_stage=3``): every weight partitioned, the
dense ones over every rank, each expert's over its expert-data-parallel group, gathered module
by module for forward and backward.

At ZeRO-1/2 DeepSpeed learns which parameters are experts from its MoE layer class
(:func:`moetrain.parallel.deepspeed.mark_experts_for_deepspeed`), which its ZeRO-3 refuses
(``DeepSpeedEngine._validate_zero3_moe_compatibility``). Its ZeRO-3 has a mechanism of its own
instead, per parameter, which its AutoEP layers use: a parameter whose
``ds_zero_placement_family`` is ``"autoep_expert"`` is partitioned over
``ds_zero_partition_process_group`` (``zero/partition_parameters.py``), and the stage-3
optimizer averages its gradient over the whole data-parallel world and adds its squares to the
global norm over the expert-parallel group named by ``ds_zero_partition_group_name``
(``zero/stage3.py``). :func:`place_experts` sets exactly what the engine's own
``_resolve_zero3_param_placement`` sets for AutoEP experts; the experts are not marked as
DeepSpeed MoE layers at stage 3, so the engine's MoE paths (the refusal among them) are not
taken. :func:`check_placement` checks, after the engine starts, that DeepSpeed partitioned and
reduces them that way, and stops the run when a DeepSpeed version no longer does
(every stage-3 Trainer runs it; tests/distributed/test_zero3.py).

Gradient scale: as at ZeRO-1/2 (:mod:`moetrain.parallel.deepspeed`), each expert's gradient
sums every EP peer's tokens, and DeepSpeed sums it over the expert-data-parallel group and
divides by the whole world: the mean over the global batch.

No rank materialises the whole model: :func:`build_partitioned` builds it on the meta device
and, one unit at a time (the embedding, each block, the final norm, the head), allocates the
unit, fills it (the model's own random init, drawn in the order of a whole-model init, or a
``checkpoint.init_from`` source's weights, :mod:`moetrain.train.zero3_build`), rounds it to the
training dtype and partitions it (``deepspeed.zero.Init(module=unit)``, which broadcasts each
parameter from the first rank of its partition group first). The peak is the largest unit
besides the partitions.

What every module must do at stage 3: read its parameters inside its own ``forward`` (the
router's gate and the LM head's chunked loss are modules for that reason,
:class:`moetrain.model.moe.router.RouterGate`, :class:`moetrain.model.loss.LMHead`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import ParallelConfig
from moetrain.parallel.expert_parallel import sharded_experts
from moetrain.parallel.topology import Topology

EXPERT_FAMILY = "autoep_expert"
"""DeepSpeed's ZeRO-3 placement family of a parameter partitioned over its expert-data-parallel
group (``module_inject/auto_ep_layer.py``)."""


def zero3_settings(p: ParallelConfig, cuda: bool) -> dict[str, Any]:
    """The stage-3 keys of DeepSpeed's ``zero_optimization`` from ``parallel.zero3_*``."""
    prefetch = p.zero3_prefetch_elements
    return {
        "stage3_prefetch_bucket_size": p.bucket_size(cuda) if prefetch is None else prefetch,
        "stage3_param_persistence_threshold": p.zero3_persistence_elements,
        "stage3_max_live_parameters": p.zero3_max_live_elements,
        "stage3_max_reuse_distance": p.zero3_max_reuse_elements,
        "stage3_gather_16bit_weights_on_model_save": False,
    }


def place_experts(module: nn.Module, topology: Topology) -> int:
    """Tag the expert parameters of every MoE layer in ``module`` for ZeRO-3: partitioned and
    reduced over their expert-data-parallel group (see the module docstring), and split into
    DeepSpeed's MoE optimizer groups (``allreduce = False``, ``group_name``); returns the number
    of layers. Needs the expert groups (the topology's)."""
    from deepspeed.utils import groups

    name = topology.ep_group_name
    edp = groups._get_expert_data_parallel_group(name)
    count = 0
    for experts in sharded_experts(module, topology.ep_size, "placing them"):
        for wname in experts.param_names:
            param = getattr(experts, wname)
            param.allreduce = False
            param.group_name = name
            param.ds_zero_placement_family = EXPERT_FAMILY
            param.ds_zero_partition_group_name = name
            param.ds_zero_partition_process_group = edp
        count += 1
    return count


def _ranks(group: Any) -> list[int]:
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group=group))]


def check_placement(engine: Any, topology: Topology) -> None:
    """After ``deepspeed.initialize`` at stage 3: every expert weight is partitioned over its
    expert-data-parallel group and every other weight over the whole world, and the stage-3
    optimizer averages expert gradients over the world and sums their norm over the
    expert-parallel group. RuntimeError naming the parameter and DeepSpeed's version when not
    (a DeepSpeed that changed its ZeRO-3 placement mechanism)."""
    import deepspeed

    opt = engine.optimizer
    world = list(range(topology.world_size))
    edp, ep = topology.expert_dp_ranks(), topology.ep_ranks()
    for name, param in engine.module.named_parameters():
        expert = getattr(param, "ds_zero_placement_family", None) == EXPERT_FAMILY
        group = getattr(param, "ds_process_group", None)
        got = None if group is None else _ranks(group)
        want = edp if expert else world
        problem = None
        if got != want:
            problem = f"partitioned over ranks {got}, expected {want}"
        elif expert and _ranks(opt._autoep_expert_parallel_group([param])) != ep:
            problem = "its gradient norm is not summed over its expert-parallel group"
        elif expert and opt._gradient_averaging_world_size([param], len(edp)) != len(world):
            problem = "its gradient is not averaged over the whole data-parallel world"
        if problem:
            raise RuntimeError(
                f"ZeRO-3 placement: {name} is {problem} (DeepSpeed {deepspeed.__version__}); "
                "moetrain relies on DeepSpeed's per-parameter ZeRO-3 placement "
                "(ds_zero_placement_family), see moetrain/parallel/zero3.py"
            )


# --------------------------------------------------------------------------- streamed build


def units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The model's top-level modules, blocks one by one, in registration order (which is the
    order of ``named_modules`` and so of a whole-model init)."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            for i, block in enumerate(child):
                yield f"{name}.{i}", block
        else:
            yield name, child


def _materialise(unit: nn.Module, device: torch.device, made: dict[int, nn.Parameter]) -> None:
    """Allocate a meta unit's parameters (uninitialised) and buffers (zeros) on ``device``,
    keeping each Parameter's attributes (the expert tags); ``made`` maps a meta parameter's id
    to its allocated one, so that a parameter shared between units (a tied head) stays one."""
    for module in unit.modules():
        for pname, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                new = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                new.__dict__.update(param.__dict__)
                made[id(param)] = new
            module._parameters[pname] = made[id(param)]
        for bname, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                module._buffers[bname] = torch.zeros_like(buf, device=device)


Fill = Callable[[str, nn.Module], None]


def training_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The weights' dtype in the engine's module: bf16 / fp16 when enabled, else fp32. (At
    ZeRO-1/2 the engine casts the module; at ZeRO-3 it leaves a partitioned module as it is,
    so the weights are partitioned in this dtype; buffers stay as they are, as the engine
    keeps them.)"""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def build_partitioned(
    model: nn.Module, device: torch.device, ds_config: dict[str, Any], fill: Fill
) -> nn.Module:
    """Partition ``model`` (built on the meta device, parallelism applied: the expert tags of
    :func:`place_experts` are kept) unit by unit: each unit is allocated on ``device``,
    ``fill(unit_name, unit)`` writes its values, and DeepSpeed partitions it. A parameter an
    earlier unit partitioned (a tied head) is gathered while ``fill`` writes it. Returns
    ``model``, every parameter a ZeRO-3 partition, its own buffers (RoPE tables) zeros."""
    import deepspeed

    dtype = training_dtype(ds_config)
    made: dict[int, nn.Parameter] = {}
    for name, unit in units(model):
        _materialise(unit, device, made)
        earlier = [p for p in unit.parameters() if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(earlier, modifier_rank=0, enabled=bool(earlier)):
            fill(name, unit)
        for param in unit.parameters():  # filled in fp32, rounded as the engine rounds at 1/2
            if not hasattr(param, "ds_id"):
                param.data = param.data.to(dtype)
        deepspeed.zero.Init(module=unit, config_dict_or_path=ds_config)
    for bname, buf in list(model._buffers.items()):
        if buf is not None and buf.device.type == "meta":
            model._buffers[bname] = torch.zeros_like(buf, device=device)
    return model
