"""StepTimer: buckets of time between marks; on CUDA events and one event wait per read, never a
device-wide synchronize (faked events here: no GPU in CI)."""

from __future__ import annotations

import pytest
import torch

from moetrain.monitor.step_timer import StepTimer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEvent:
    """Records the fake clock's time; elapsed_time in milliseconds, like torch.cuda.Event."""

    log: list[str] = []

    def __init__(self, clock: Clock) -> None:
        self.clock, self.t = clock, None

    def record(self) -> None:
        self.t = self.clock()

    def synchronize(self) -> None:
        FakeEvent.log.append(f"sync@{self.t}")

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3


def _micro_steps(timer: StepTimer, clock: Clock) -> None:
    """Two micro-steps: fwd_bwd 0-3 and 5-6 (the gap 3-5 is outside), optimizer 6-10."""
    for start, end, step_end in ((0, 3, None), (5, 6, 10)):
        clock.now = start
        timer.start()
        clock.now = end
        timer.lap("fwd_bwd")
        if step_end is not None:
            clock.now = step_end
            timer.lap("optimizer")


def test_host_clock_buckets() -> None:
    clock = Clock()
    timer = StepTimer(torch.device("cpu"), clock=clock)
    assert not timer.use_events
    _micro_steps(timer, clock)
    assert timer.read() == {"fwd_bwd": 4.0, "optimizer": 4.0}
    assert timer.read() == {}  # cleared


def test_cuda_events_without_device_synchronize(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("torch.cuda.synchronize on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    clock = Clock()
    FakeEvent.log = []
    timer = StepTimer(torch.device("cuda", 0), event_factory=lambda: FakeEvent(clock))
    assert timer.use_events
    _micro_steps(timer, clock)
    assert FakeEvent.log == []  # nothing waits while the step runs
    assert timer.read() == pytest.approx({"fwd_bwd": 4.0, "optimizer": 4.0})
    assert FakeEvent.log == ["sync@10"]  # one wait, for the last event only


def test_lap_needs_start() -> None:
    with pytest.raises(RuntimeError, match="without start"):
        StepTimer(torch.device("cpu")).lap("fwd_bwd")
