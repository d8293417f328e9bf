"""A run's progress: what it has done so far, saved in every checkpoint and restored on resume."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Progress:
    """How far a run has come.

    ``step`` counts optimizer steps taken (skipped ones included: they consume data),
    ``tokens_seen`` the training tokens they consumed on every rank together, ``skipped_steps``
    the non-finite steps, ``loss_scale_overflows`` the fp16 loss-scale calibration skips
    (:mod:`moetrain.train.nonfinite`); ``init`` is what the run's first weights were loaded from
    (``checkpoint.init_from``; None for random weights), carried by every checkpoint of the run.
    """

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    loss_scale_overflows: int = 0
    init: dict[str, Any] | None = None

    def advance(self, tokens: int, skipped: bool, calibration: bool) -> None:
        """One optimizer step done: ``tokens`` consumed; a skip counts as a loss-scale overflow
        when it was ``calibration``, else as a skipped step."""
        self.step += 1
        self.tokens_seen += tokens
        if calibration:
            self.loss_scale_overflows += 1
        elif skipped:
            self.skipped_steps += 1

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (the fields by name)."""
        return copy.deepcopy(asdict(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; every field must be given, and nothing else."""
        names = {f.name for f in fields(self)}
        if set(state) != names:
            raise ValueError(
                f"progress state: expected the keys {sorted(names)}, got {sorted(state)}"
            )
        for name in names:
            setattr(self, name, copy.deepcopy(state[name]))
