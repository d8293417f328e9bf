"""Skipped optimizer steps: the counter that stops a diverging run, and fp16 loss-scale
calibration, which is not divergence.

A step is skipped when any rank's gradients are not finite; every rank takes the same decision
(:mod:`moetrain.train.step`). Under fp16, DeepSpeed's dynamic loss scaler starts high (2^16) and
halves the scale after overflows (after ``hysteresis`` = 2 of them in a row) until the scaled
gradients fit: those skips are calibration. A skip counts as *calibration* when the loss is
finite and the scale can still go down (it is above the scaler's minimum); it is counted apart
(``loss_scale_overflows``) and never toward ``train.max_nonfinite_in_a_row``. Every other skip
(bf16 or fp32, a non-finite loss, or an fp16 overflow at the minimum scale) counts, and after
that many in a row training stops with an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moetrain.monitor.console import Printer, console

# DeepSpeed DynamicLossScaler attributes that change during training (the rest is config)
SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


@dataclass(frozen=True)
class LossScale:
    """The dynamic loss scale before a step, and the lowest it may go."""

    scale: float
    min_scale: float

    @property
    def can_decrease(self) -> bool:
        return self.scale > self.min_scale


def dynamic_loss_scaler(optimizer: Any) -> Any | None:
    """DeepSpeed's dynamic loss scaler of an engine's optimizer (fp16), else None."""
    scaler = getattr(optimizer, "loss_scaler", None)
    return scaler if getattr(scaler, "dynamic", False) else None


def read_loss_scale(optimizer: Any) -> LossScale | None:
    """The loss scale before the coming step (None without dynamic loss scaling).

    Also turns off the scaler's exception at the minimum scale (it would be raised in the middle
    of DeepSpeed's step, on the first overflow there): such overflows are skipped steps that
    count toward ``train.max_nonfinite_in_a_row`` instead.
    """
    scaler = dynamic_loss_scaler(optimizer)
    if scaler is None:
        return None
    scaler.raise_error_at_min_scale = False
    return LossScale(float(scaler.cur_scale), float(scaler.min_scale))


def loss_scaler_state(optimizer: Any) -> dict[str, float] | None:
    """The dynamic loss scaler's state as plain numbers (JSON), or None without one."""
    scaler = dynamic_loss_scaler(optimizer)
    if scaler is None:
        return None
    return {name: getattr(scaler, name) for name in SCALER_STATE}


def load_loss_scaler_state(optimizer: Any, state: dict[str, float] | None) -> None:
    """Restore :func:`loss_scaler_state` into the engine's scaler (also after
    ``--reset-optimizer``, which restarts DeepSpeed's own copy at the initial scale)."""
    scaler = dynamic_loss_scaler(optimizer)
    if scaler is None or not state:
        return
    missing = [name for name in SCALER_STATE if name not in state]
    if missing:
        raise ValueError(f"loss scaler state: missing {missing}")
    for name in SCALER_STATE:
        setattr(scaler, name, type(getattr(scaler, name))(state[name]))


class LossScalerState:
    """The dynamic loss scaler of an engine's optimizer as an object a checkpoint saves and
    restores (its state is None without one)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, float] | None:
        return loss_scaler_state(self.optimizer)

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        load_loss_scaler_state(self.optimizer, state)


class SkipCounter:
    """Accounts for skipped steps; raises after ``limit`` non-finite steps in a row.

    ``overflows`` counts fp16 loss-scale calibration skips since this object was made.
    """

    def __init__(self, limit: int, printer: Printer = console) -> None:
        self.limit, self.printer = limit, printer
        self.in_a_row = 0
        self.overflows = 0

    def update(
        self,
        skipped: bool,
        step: int,
        loss: float,
        grad_norm: float,
        main: bool,
        scale: LossScale | None = None,
        scale_after: float | None = None,
    ) -> bool:
        """One step's outcome (``scale``: the loss scale before the step, fp16 only; on every
        rank the same). Returns True when a skip was loss-scale calibration."""
        if not skipped:
            self.in_a_row = 0
            return False
        if scale is not None and scale.can_decrease and math.isfinite(loss):
            self.overflows += 1
            if main:
                after = scale.scale if scale_after is None else scale_after
                self.printer(
                    f"step {step}: fp16 loss-scale overflow, step skipped (scale {scale.scale:g} "
                    f"-> {after:g}; calibration, {self.overflows} so far)"
                )
            return True
        self.in_a_row += 1
        if main:
            self.printer(
                f"step {step}: skipped (loss {loss}, grad norm {grad_norm}); "
                f"{self.in_a_row} in a row"
            )
        if self.in_a_row >= self.limit:
            fp16 = scale is not None
            raise FloatingPointError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients"
                f"{' at the minimum fp16 loss scale' if fp16 else ''} (step {step}, "
                f"train.max_nonfinite_in_a_row={self.limit}); lower optim.lr or check the data"
                f"{', or use train.precision=bf16 (the range of fp32)' if fp16 else ''}"
            )
        return False
