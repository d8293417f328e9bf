"""Stopping on a signal: SIGTERM / SIGINT set a flag that every rank agrees on at a step
boundary, so a signal delivered to any single rank (SLURM preemption, Ctrl-C) makes every rank
save a checkpoint and exit 0."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist


class StopSignal:
    """Installs handlers for SIGTERM and SIGINT that record the signal (``received``)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def agree_any(topo: Any, flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over every rank (one all-reduce; ``topo``: the run's Topology)."""
    if topo.world_size == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=topo.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]
