"""A resume that changes layout to or from ZeRO-3 (``parallel.zero_stage=3``).

DeepSpeed's loader reads its model files only on a ZeRO-3 layout like the one that wrote them,
and a ZeRO-3 checkpoint has no dense or per-expert files. So, whenever stage 3 is on either
side of a layout change, the model weights come from moetrain's reader
(:func:`moetrain.checkpoint.read.iter_layer_states`: the dense weights, then one layer's experts
at a time, from any stage's files) and are written into the running engine by
:func:`load_weights`: whole into the parameters at stages 0-2, into each parameter's partition
(and its fp32 master) at stage 3. The optimizer state of a stage-3 engine is written by
:func:`restore_zero3_optimizer` (stages 0-2: :func:`moetrain.checkpoint.reshard.
restore_optimizer`).

A ZeRO-3 partition of a parameter of ``n`` values over a group of ``g`` ranks is the slice
``[r*s, (r+1)*s)`` of the flattened parameter, ``s = ceil(n / g)``, at the rank's place ``r`` in
the group (the last one padded): DeepSpeed's ``partition_parameters.py``; experts are
partitioned over their expert-data-parallel group (:mod:`moetrain.parallel.zero3`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moetrain.checkpoint.format import CheckpointError
from moetrain.checkpoint.read import iter_layer_states
from moetrain.checkpoint.reshard import MASTER, SavedOptimizer, is_expert_param

if TYPE_CHECKING:
    from moetrain.config import Config


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 partitioned parameter."""
    return hasattr(param, "ds_tensor")


def partition_of(param: torch.Tensor, value: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's ZeRO-3 partition of ``value`` (the whole parameter ``name``), as long as the
    parameter's partition (padded with zeros)."""
    if value.numel() != param.ds_numel:
        raise CheckpointError(
            f"{name}: the checkpoint holds {tuple(value.shape)}, the model {tuple(param.ds_shape)}"
        )
    size = param.ds_tensor.ds_numel
    place = dist.get_rank(group=param.ds_process_group)
    flat = value.reshape(-1)[place * size : (place + 1) * size]
    return torch.cat([flat, flat.new_zeros(size - flat.numel())]) if flat.numel() < size else flat


def _set(param: torch.Tensor, value: torch.Tensor, name: str, optimizer: Any) -> None:
    if not is_partitioned(param):
        if value.shape != param.shape:
            raise CheckpointError(
                f"{name}: the checkpoint holds {tuple(value.shape)}, the model {tuple(param.shape)}"
            )
        param.data.copy_(value)
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    local = partition_of(param, value, name)
    param.ds_tensor.data.copy_(local)
    optimizer.set_local_hp_param(local.float(), param)  # the fp32 master, unrounded
    if param.ds_status == ZeroParamStatus.AVAILABLE:  # a persistent (whole) parameter
        param.data.copy_(value.reshape(param.ds_shape))


@torch.no_grad()
def load_weights(engine: Any, ckpt: Path, cfg: Config, experts: tuple[int, int]) -> None:
    """Write ``ckpt``'s model weights and buffers (any layout) into ``engine``'s module, whose
    rank holds the global experts ``experts = [start, stop)``; CheckpointError naming a tensor
    that is missing, extra or of another shape."""
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    buffers = dict(engine.module.named_buffers())
    seen: set[str] = set()
    for _, part in iter_layer_states(ckpt, cfg):
        for name, value in part.items():
            if is_expert_param(name):
                value = value[experts[0] : experts[1]]
            if name in params:
                _set(params[name], value, name, engine.optimizer)
            elif name in buffers:
                buffers[name].copy_(value)
            else:
                raise CheckpointError(f"{ckpt}: {name} is not a tensor of this model")
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"{ckpt}: holds no {missing[:5]} (of {len(missing)} missing)")
    if not any(is_partitioned(p) for p in params.values()):
        refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:  # ZeRO-1/2: masters from the weights, as DeepSpeed's loader
            refresh()


@torch.no_grad()
def restore_zero3_optimizer(engine: Any, saved: SavedOptimizer, experts: tuple[int, int]) -> None:
    """Put ``saved``'s optimizer state (any layout) into a ZeRO-3 ``engine`` whose weights
    :func:`load_weights` wrote: every state tensor of every parameter into this rank's
    partition (the state created for each sub-group when the engine has not stepped yet), the
    step count into every sub-group."""
    opt = engine.optimizer
    keys_of = []  # per sub-group: the state keys of its param group
    for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
        keys = saved.spec.state_keys(opt.optimizer.param_groups[opt.sub_group_to_group_id[i]])
        state = opt.optimizer.state[flat]
        for key in keys:
            state.setdefault(key, torch.zeros_like(flat))
        state["step"] = saved.step.to(flat.device).clone()
        keys_of.append(keys)
    for name, param in engine.module.named_parameters():
        keys = keys_of[opt.grad_position[opt.get_param_id(param)][0]]
        for key in ([MASTER] if saved.has_master() else []) + list(keys):
            if is_expert_param(name):
                value = saved.expert_rows(name, key, *experts)
            else:
                value = saved.full(name, key)
            local = partition_of(param, value, name).float()
            opt.set_local_hp_param(local, param, optim_state_key=None if key == MASTER else key)
    for attr, value in saved.counters.items():
        if value is not None:
            setattr(engine, attr, value)
