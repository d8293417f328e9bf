"""DeepSpeed integration: config from ours, the MoE marker shim, engine construction, clipping.

DeepSpeed treats a model as MoE only if a module is an instance of ``deepspeed.moe.layer.MoE``.
:func:`mark_experts_for_deepspeed` turns each MoE layer's ``experts`` module into such an
instance (a marker subclass of its own class; the stacked weights, forward and parameter names
stay as they are), tags expert parameters ``allreduce=False`` / ``group_name='ep_size_<P>'`` so
DeepSpeed reduces them over their expert-data-parallel group only, and adds state-dict hooks
that write per-expert keys ``<prefix>deepspeed_moe.experts.deepspeed_experts.<local_i>.<w>`` (so
DeepSpeed saves one file per global expert) and stack them back on load.

Gradient scale: each expert's gradient already sums the contributions of every EP peer's tokens
(backward of the all-to-all); DeepSpeed then sums over the expert-data-parallel group and divides
by the whole data-parallel size (stage 0: ``_reduce_expert_gradients``; ZeRO-1/2: the bucket
reduction divides every bucket by the dp world size), which is the mean over the global batch.
No correction is needed; tests/distributed/test_parity.py checks it against one process.

Clipping: ZeRO-1/2 compute the global norm correctly. Stage 0 does not (DeepSpeed issue #8475:
it averages per-rank norms over ranks that hold different experts), so at stage 0 DeepSpeed's
clipping is switched off and the trainer calls :func:`clip_grad_norm_global` before each step.
ZeRO-3 computes it correctly too; its expert placement is :mod:`moetrain.parallel.zero3`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moetrain.checkpoint.format import deepspeed_expert_key
from moetrain.config import Config, ConfigError
from moetrain.fileio import write_json_atomic
from moetrain.model.moe.experts import EXPERT_BIASES, EXPERT_WEIGHTS
from moetrain.parallel.expert_parallel import sharded_experts
from moetrain.parallel.fp32_partitions import share_fp32_partitions, share_zero3_fp32_partitions
from moetrain.parallel.grad_partitions import flatten_grad_partitions_in_place
from moetrain.parallel.topology import Topology
from moetrain.parallel.zero3 import zero3_settings


def deepspeed_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON config for ``cfg`` on ``world_size`` ranks."""
    t, p, o = cfg.train, cfg.parallel, cfg.optim
    cuda = torch.cuda.is_available()
    bucket = cfg.parallel.bucket_size(cuda)
    zero: dict[str, Any] = {
        "stage": p.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": cuda if p.overlap_comm is None else p.overlap_comm,
        "reduce_scatter": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if p.zero_stage == 3:
        zero.update(zero3_settings(p, cuda))
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.micro_batch_size * t.grad_accum_steps * world_size,
        # stage 0: moetrain clips with a correct global norm (see module docstring)
        "gradient_clipping": o.grad_clip if p.zero_stage > 0 else 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # bf16: skip a step whose gradients are not finite (the ZeRO optimizers check, all ranks
        # agree through an all-reduce; fp16 always checks); ZeRO-1 with fp32 accumulation adds
        # each bf16 gradient to its fp32 buffer as soon as it is ready and frees it
        "bf16": {
            "enabled": t.precision == "bf16",
            "check_grad_overflow": True,
            "immediate_grad_update": True,
        },
        "fp16": {
            "enabled": t.precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        # the numerics policy (README "Mixed precision"): accumulate gradients over micro-batches
        # and reduce them over ranks in train.grad_dtype (fp32 by default; ZeRO-1/2/3 only, which
        # config/layout.py enforces for bf16/fp16)
        "data_types": {"grad_accum_dtype": t.grad_dtype},
        "communication_data_type": t.grad_dtype,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return ds


def check_precision_supported(precision: str) -> None:
    """Refuse a ``train.precision`` that this machine's accelerator cannot run, with the same
    test DeepSpeed applies (``is_fp16_supported`` / ``is_bf16_supported``), but before any
    process group starts. Raises ``ConfigError`` naming the key."""
    if precision == "fp32":
        return
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    supported = acc.is_fp16_supported() if precision == "fp16" else acc.is_bf16_supported()
    if not supported:
        other = "bf16" if precision == "fp16" else "fp16"
        hint = f"use train.precision={other} if it has that, or fp32"
        raise ConfigError(
            f"train.precision: {precision} is not supported by this machine's accelerator "
            f"({acc.device_name()}, as DeepSpeed detects it); {hint}"
        )


def dump_deepspeed_config(ds_config: dict[str, Any], run_dir: str | Path) -> Path:
    """Write the DeepSpeed config to ``run_dir/deepspeed_config.json`` for inspection."""
    path = Path(run_dir) / "deepspeed_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, ds_config, sort_keys=False)
    return path


# --------------------------------------------------------------------------- MoE marker shim

_MARKER_CLASSES: dict[type, type] = {}


def _set_deepspeed_parallelism(self: Any, use_data_before_expert_parallel_: bool = False) -> None:
    """Called by the engine: the groups were created by the topology; check they exist."""
    from deepspeed.utils import groups

    if self.expert_group_name not in groups._get_expert_parallel_group_dict():
        raise RuntimeError(
            f"expert group {self.expert_group_name} missing: create the topology first"
        )


def _marker_class(cls: type) -> type:
    from deepspeed.moe.layer import MoE

    if cls not in _MARKER_CLASSES:
        _MARKER_CLASSES[cls] = type(
            f"DeepSpeedMarked{cls.__name__}",
            (cls, MoE),
            {"set_deepspeed_parallelism": _set_deepspeed_parallelism, "__module__": __name__},
        )
    return _MARKER_CLASSES[cls]


def _per_expert_state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for wname in EXPERT_WEIGHTS + EXPERT_BIASES:
        key = prefix + wname
        if key in state_dict:
            stacked = state_dict.pop(key)
            for i in range(stacked.shape[0]):
                state_dict[deepspeed_expert_key(prefix, i, wname)] = stacked[i]


def _stack_experts_load_pre_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    n = module.num_local_experts
    for wname in module.param_names:
        keys = [deepspeed_expert_key(prefix, i, wname) for i in range(n)]
        if all(k in state_dict for k in keys):
            state_dict[prefix + wname] = torch.stack([state_dict.pop(k) for k in keys])


def mark_experts_for_deepspeed(model: nn.Module, topology: Topology) -> int:
    """Mark every MoE layer's experts for DeepSpeed (in place); returns the number marked."""
    count = 0
    for experts in sharded_experts(model, topology.ep_size, "marking them"):
        # DeepSpeed's MoE reads num_experts (global), num_local_experts, ep_size and the group
        experts.__class__ = _marker_class(type(experts))
        experts.ep_size = topology.ep_size
        experts.expert_group_name = topology.ep_group_name
        experts.enable_expert_tensor_parallelism = False
        for wname in experts.param_names:  # (the biases too, with moe.expert_biases)
            param = getattr(experts, wname)
            param.allreduce = False
            param.group_name = topology.ep_group_name
        experts._register_state_dict_hook(_per_expert_state_dict_hook)
        experts._register_load_state_dict_pre_hook(_stack_experts_load_pre_hook, with_module=True)
        count += 1
    return count


def is_ep_sharded(param: Tensor) -> bool:
    """A parameter DeepSpeed keeps per expert-parallel rank (marked ``allreduce = False`` by
    :func:`mark_experts_for_deepspeed`; reduced over its expert-data-parallel group only). The name
    rule for expert weights in a checkpoint is ``checkpoint.reshard.is_expert_param``."""
    return getattr(param, "allreduce", True) is False


# --------------------------------------------------------------------------- clipping


@torch.no_grad()
def global_grad_norm(model: nn.Module, topology: Topology) -> Tensor:
    """L2 norm of all gradients after the data-parallel reduction (stage 0 layout).

    Dense gradients are identical on every rank; each expert's gradient lives on one rank of
    every expert-parallel group, so expert squares are summed over the EP group only.
    """
    dense = torch.zeros((), dtype=torch.float64, device=topology.device)
    expert = torch.zeros((), dtype=torch.float64, device=topology.device)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if is_ep_sharded(p):
            expert += sq
        else:
            dense += sq
    if topology.ep_size > 1:
        dist.all_reduce(expert, op=dist.ReduceOp.SUM, group=topology.ep_group)
    return (dense + expert).sqrt().float()


@torch.no_grad()
def clip_grad_norm_global(model: nn.Module, max_norm: float, topology: Topology) -> float:
    """Clip gradients in place to ``max_norm`` with the correct global norm; return the norm.

    Same coefficient as ``torch.nn.utils.clip_grad_norm_`` and DeepSpeed ZeRO:
    ``min(1, max_norm / (norm + 1e-6))``.
    """
    norm = global_grad_norm(model, topology)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return float(norm)


# --------------------------------------------------------------------------- engine


def initialize_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_schedule: Callable[[Any], Any],
    ds_config: dict[str, Any],
) -> tuple[Any, Any, Any]:
    """Start the DeepSpeed engine; returns ``(engine, ds_optimizer, schedule)``.

    The model must already be parallel (:func:`moetrain.parallel.apply.apply_parallelism`) and
    on its device; ``make_schedule(ds_optimizer)`` builds the learning-rate schedule on the
    optimizer DeepSpeed wraps. The schedule is not handed to DeepSpeed (which steps it after a
    stage-0 skip but not after a ZeRO-1/2 one): the caller steps it after every step that was
    not skipped.
    """
    import deepspeed

    fp32_buffers = [
        name
        for name, buf in model.named_buffers()
        if buf.dtype == torch.float32 and name.endswith("expert_bias")
    ]
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
    )
    share_fp32_partitions(ds_optimizer)  # fp32 ZeRO-1/2: no clone of the weights
    share_zero3_fp32_partitions(ds_optimizer)  # and at ZeRO-3
    flatten_grad_partitions_in_place(ds_optimizer)  # ZeRO-1/2: no gradient copy at the step
    # bf16/fp16 engines cast buffers; balancing biases stay fp32 (sign updates need range).
    modules = dict(engine.module.named_modules())
    for name in fp32_buffers:
        mod_name, _, attr = name.rpartition(".")
        mod = modules[mod_name]
        current = getattr(mod, attr)
        if current.dtype != torch.float32:
            setattr(mod, attr, current.float())
    return engine, ds_optimizer, make_schedule(ds_optimizer)
