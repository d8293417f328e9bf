"""AdamW (``optim.name: adamw``, the default): decoupled weight decay on the matrices
(:func:`moetrain.optim.groups.decay_groups`), two fp32 moments per parameter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from moetrain.config import OptimConfig
from moetrain.monitor.console import console
from moetrain.optim.groups import decay_groups
from moetrain.optim.spec import OptimizerSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def adamw(
    model: nn.Module, groups: list[dict[str, Any]], optim: OptimConfig, device: torch.device
) -> Any:
    """AdamW: DeepSpeed's FusedAdam on CUDA when it builds, otherwise torch's fused AdamW (one
    kernel per tensor; on CPU about 8x faster than the per-op implementation on a ZeRO
    partition, see benchmarks/HISTORY.md). Global rank 0 says which one runs; a rank where
    FusedAdam failed to build says why."""
    import torch

    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    if device.type == "cuda":
        try:
            from deepspeed.ops.adam import FusedAdam

            opt = FusedAdam(groups, adam_w_mode=True, weight_decay=optim.weight_decay, **kwargs)
            say("optimizer: DeepSpeed FusedAdam")
            return opt
        except Exception as exc:  # op not buildable here: torch's fused kernel is the next best
            say(
                f"optimizer: DeepSpeed FusedAdam could not be built ({type(exc).__name__}: "
                f"{exc}); using torch.optim.AdamW(fused=True)",
                every_rank=True,
            )
            return torch.optim.AdamW(groups, fused=True, **kwargs)
    say("optimizer: torch.optim.AdamW(fused=True)")
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def say(message: str, every_rank: bool = False) -> None:
    """The console line on global rank 0 (prefixed with the rank on the others)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        console(message)
    elif every_rank:
        console(f"rank {rank}: {message}")


def adam_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    """AdamW's state tensors: its two moments."""
    return ADAM_KEYS


def _update_of(name: str, ndim: int, optim: OptimConfig) -> str:
    return "adamw"


ADAMW = OptimizerSpec(
    name="adamw",
    update_of=_update_of,
    update_bytes={"adamw": 8},
    param_groups=decay_groups,
    build=adamw,
    state_keys=adam_keys,
)
