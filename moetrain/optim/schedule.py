"""Learning-rate schedules, independent of the optimizer: they set ``lr`` of every param
group, whatever update the group takes.

Linear warmup from ``lr / warmup`` to ``lr`` over ``warmup`` optimizer steps, then ``cosine`` /
``linear`` to ``min_lr_ratio * lr`` at the last step, ``constant``, or ``wsd`` (warmup, stable
at ``lr``, then a linear decay to ``min_lr_ratio * lr`` over the last ``decay_fraction`` of the
steps). Warmup may be given in tokens (``optim.warmup_tokens``).
"""

from __future__ import annotations

import math
from typing import Any

from moetrain.config import OptimConfig


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
