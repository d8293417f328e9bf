"""When the run loop logs, evaluates and saves: small objects asked once per step."""

from __future__ import annotations

import time


class Periodic:
    """Due every ``every`` steps (0 = never), and at the steps in ``also``."""

    def __init__(self, every: int, also: tuple[int, ...] = ()) -> None:
        self.every, self.also = every, also

    def due(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or step in self.also


class Clock:
    """Due once ``minutes`` have passed since the last :meth:`reset` (0 = never)."""

    def __init__(self, minutes: float) -> None:
        self.minutes = minutes
        self.reset()

    def reset(self) -> None:
        self._since = time.perf_counter()

    def due(self) -> bool:
        return self.minutes > 0 and (time.perf_counter() - self._since) / 60 >= self.minutes
