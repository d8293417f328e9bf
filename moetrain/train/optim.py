"""Optimiser parameter groups and learning-rate schedules.

Groups: ``decay`` (matrices) and ``no_decay`` (norm weights, biases, and embeddings unless
``optim.decay_embeddings``). Expert weights (``param.allreduce == False``, set by the
expert-parallel code) are moved into DeepSpeed MoE groups (``'moe': True``, ``'name'`` =
their expert group) so ZeRO reduces and partitions them over their expert-data-parallel group.

Schedules: linear warmup from ``lr / warmup`` to ``lr`` over ``warmup`` optimizer steps, then
``cosine`` / ``linear`` to ``min_lr_ratio * lr`` at the last step, ``constant``, or ``wsd``
(warmup, stable at ``lr``, then a linear decay to ``min_lr_ratio * lr`` over the last
``decay_fraction`` of the steps). Warmup may be given in tokens (``optim.warmup_tokens``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from moetrain.config import OptimConfig
from moetrain.monitor.console import console

EMBEDDING_NAMES = ("embed.weight",)


def is_no_decay(name: str, param: torch.Tensor, decay_embeddings: bool) -> bool:
    """Norm weights and biases (anything 1-D) never decay; embeddings only if configured. (A
    ZeRO-3 partition's shape is its ``ds_shape``.)"""
    if len(getattr(param, "ds_shape", param.shape)) < 2 or name.endswith(".bias"):
        return True
    return not decay_embeddings and name in EMBEDDING_NAMES


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """Decay / no-decay groups, split further into DeepSpeed MoE groups for expert weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if is_no_decay(name, p, optim.decay_embeddings) else decay).append(p)
    groups: list[dict[str, Any]] = [
        {"name": "decay", "params": decay, "weight_decay": optim.weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module, optim: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW: DeepSpeed's FusedAdam on CUDA when it builds, otherwise torch's fused AdamW (one
    kernel per tensor; on CPU about 8x faster than the per-op implementation on a ZeRO
    partition, see benchmarks/RESULTS.md). Global rank 0 says which one runs; a rank where
    FusedAdam failed to build says why."""
    groups = param_groups(model, optim)
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    if device.type == "cuda":
        try:
            from deepspeed.ops.adam import FusedAdam

            opt = FusedAdam(groups, adam_w_mode=True, weight_decay=optim.weight_decay, **kwargs)
            _say("optimizer: DeepSpeed FusedAdam")
            return opt
        except Exception as exc:  # op not buildable here: torch's fused kernel is the next best
            _say(
                f"optimizer: DeepSpeed FusedAdam could not be built ({type(exc).__name__}: "
                f"{exc}); using torch.optim.AdamW(fused=True)",
                every_rank=True,
            )
            return torch.optim.AdamW(groups, fused=True, **kwargs)
    _say("optimizer: torch.optim.AdamW(fused=True)")
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def _say(message: str, every_rank: bool = False) -> None:
    """The console line on global rank 0 (prefixed with the rank on the others)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        console(message)
    elif every_rank:
        console(f"rank {rank}: {message}")


def warmup_steps_for(optim: OptimConfig, tokens_per_step: int) -> int:
    """Warmup length in optimizer steps (``optim.warmup_tokens`` wins when set)."""
    if optim.warmup_tokens is not None:
        return math.ceil(optim.warmup_tokens / max(1, tokens_per_step))
    return optim.warmup_steps


def lr_factor(step: int, total_steps: int, warmup: int, optim: OptimConfig) -> float:
    """Multiplier of ``optim.lr`` for optimizer step ``step`` (0-based) of ``total_steps``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    floor = optim.min_lr_ratio
    if optim.schedule == "constant":
        return 1.0
    last = max(total_steps - 1, 0)
    if optim.schedule == "wsd":
        decay_steps = max(1, math.ceil(optim.decay_fraction * total_steps))
        start = max(warmup, total_steps - decay_steps)
        if step < start:
            return 1.0
        progress = min(1.0, (step - start + 1) / max(1, last - start + 1))
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, max(0.0, (step - warmup) / max(1, last - warmup)))
    if optim.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    if optim.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"optim.schedule: unknown schedule {optim.schedule!r}")


class LRSchedule:
    """Sets ``lr`` of every param group; ``step()`` once per optimizer step (DeepSpeed does).

    Has the ``step`` / ``get_last_lr`` / ``state_dict`` / ``load_state_dict`` interface DeepSpeed
    expects from a scheduler, and works on a plain or a ZeRO-wrapped optimizer.
    """

    def __init__(
        self, optimizer: Any, optim: OptimConfig, total_steps: int, tokens_per_step: int
    ) -> None:
        self.optimizer = optimizer
        self.optim = optim
        self.total_steps = total_steps
        self.warmup = warmup_steps_for(optim, tokens_per_step)
        self.last_step = 0  # the optimizer step the current lr is for
        self._apply()

    def lr_at(self, step: int) -> float:
        return self.optim.lr * lr_factor(step, self.total_steps, self.warmup, self.optim)

    def _apply(self) -> None:
        lr = self.lr_at(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, **_: Any) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [self.lr_at(self.last_step)]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])
        self._apply()
