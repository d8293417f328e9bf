"""Time the parts of a training step without a device-wide synchronize on the hot path.

``timer.start()`` opens an interval, ``timer.lap(name)`` closes it into the bucket ``name`` and
opens the next one at the same point, ``timer.read()`` returns the seconds per bucket and clears
them. On CUDA every mark records an event on the current stream, so a bucket holds the device
time on that stream between its marks (the work queued there, and any wait for other streams
that the work itself contains); ``read`` waits for the last event only (``Event.synchronize``),
so call it where the step already waits for its results. Anywhere else the marks are host
clock readings: CPU work is synchronous, so they measure the same thing.

What changes against a ``torch.cuda.synchronize`` at every mark: nothing is drained between the
marks, so gradient reductions that DeepSpeed overlaps on its own streams count in the bucket
whose stream work first waits for them (the optimizer step) rather than where they were
launched, and the host keeps queueing work while the device runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

EventFactory = Callable[[], Any]


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class StepTimer:
    """Device time between marks, accumulated per bucket and read once per step.

    ``device``: CUDA devices use events (``event_factory``, default ``torch.cuda.Event`` with
    timing; a test can pass its own), any other device ``clock`` (default ``time.perf_counter``).
    """

    def __init__(
        self,
        device: torch.device,
        event_factory: EventFactory | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.use_events = device.type == "cuda"
        self._event = event_factory or _cuda_event
        self._clock = clock
        self._open: Any = None
        self._intervals: list[tuple[str, Any, Any]] = []

    def _mark(self) -> Any:
        if not self.use_events:
            return self._clock()
        event = self._event()
        event.record()
        return event

    def start(self) -> None:
        """Open an interval here (an interval still open is discarded)."""
        self._open = self._mark()

    def lap(self, name: str) -> None:
        """Close the open interval into bucket ``name``; the next one opens at the same point."""
        if self._open is None:
            raise RuntimeError(f"StepTimer.lap({name!r}) without start()")
        end = self._mark()
        self._intervals.append((name, self._open, end))
        self._open = end

    def read(self) -> dict[str, float]:
        """Seconds per bucket since the last read; clears the buckets (the open interval stays)."""
        totals: dict[str, float] = {}
        if self._intervals and self.use_events:
            self._intervals[-1][2].synchronize()  # this event only, not the whole device
        for name, start, end in self._intervals:
            seconds = start.elapsed_time(end) / 1e3 if self.use_events else end - start
            totals[name] = totals.get(name, 0.0) + seconds
        self._intervals = []
        return totals
