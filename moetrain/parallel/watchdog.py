"""Which rank is missing when a collective fails: heartbeats and phases in the job's store.

Every rank runs a small thread that, once a second, bumps its heartbeat counter in the job's
key-value store together with the phase the rank is in (``RankWatch.phase``: a short text set
by the run loop and the checkpointer; the main thread never touches the store for it). When a
collective times out or loses a peer, the failing rank reads every rank's counter twice, a few
seconds apart: a rank whose counter did not move is stopped or dead (SIGSTOP, a crash, a lost
node), a rank whose counter moved but whose phase differs is alive elsewhere (a hang or a
straggler). :meth:`RankWatch.explain` turns that into one message that names the collective
(from the failing call's traceback), this rank's phase, and the missing ranks with theirs.
"""

from __future__ import annotations

import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: every CLI command imports this module, torch-free
    import torch.distributed as dist

_KEY = "moetrain/heartbeat"
_STORE_TIMEOUT = timedelta(seconds=10)  # a diagnosis never waits long on a dead store


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message names it and the missing ranks."""


def _chain(error: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while error is not None and error not in out:
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


def is_collective_failure(error: BaseException) -> bool:
    """``error`` (or what caused it) was raised inside a torch.distributed call."""
    import torch.distributed as dist

    for e in _chain(error):
        if isinstance(e, dist.DistError):
            return True
        for frame in traceback.extract_tb(e.__traceback__):
            if "/torch/distributed/" in frame.filename.replace("\\", "/"):
                return True
    return False


def collective_of(error: BaseException) -> str:
    """The torch.distributed call (and the moetrain line) that raised ``error``."""
    torch_call = ours = None
    frames = [f for e in reversed(_chain(error)) for f in traceback.extract_tb(e.__traceback__)]
    for frame in frames:
        path = frame.filename.replace("\\", "/")
        if "/torch/distributed/" in path and not path.endswith("c10d_logger.py"):
            torch_call = frame.name
        elif "/moetrain/" in path:
            ours = f"{path[path.rindex('/moetrain/') + 1 :]}:{frame.lineno} ({frame.name})"
    if torch_call and ours:
        return f"{torch_call} called from {ours}"
    return torch_call or ours or "unknown"


class RankWatch:
    """Heartbeat and phase of this rank in ``store``; start with :meth:`start`."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval_s: float = 1.0):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._beat_store = store.clone()  # the thread's own connection
        self._read_store = store.clone()
        for s in (self._beat_store, self._read_store):
            s.set_timeout(_STORE_TIMEOUT)
        self._phase = "starting"
        self._stop = threading.Event()
        self._changed = threading.Event()  # a new phase: publish it now, not at the next beat
        self._thread = threading.Thread(target=self._beat, name="moetrain-heartbeat", daemon=True)

    def start(self) -> RankWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=5 * self.interval_s)

    def phase(self, what: str) -> None:
        """Record what this rank is doing now (the heartbeat thread publishes it at once)."""
        self._phase = what
        self._changed.set()

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            self._changed.clear()
            try:
                self._beat_store.set(f"{_KEY}/{self.rank}", f"{count}|{self._phase}")
            except Exception:  # the store is gone (its host died): nothing left to tell
                return
            self._changed.wait(self.interval_s)

    def _read(self) -> dict[int, tuple[int, str] | None]:
        out: dict[int, tuple[int, str] | None] = {}
        for r in range(self.world_size):
            key = f"{_KEY}/{r}"
            if not self._read_store.check([key]):
                out[r] = None
                continue
            count, _, phase = self._read_store.get(key).decode().partition("|")
            out[r] = (int(count), phase)
        return out

    def missing_ranks(self) -> tuple[dict[int, str], dict[int, str]]:
        """``(stopped, elsewhere)``: rank -> its last phase, for ranks whose heartbeat stopped
        over a few intervals, and for live ranks in another phase than this one."""
        before = self._read()
        time.sleep(3 * self.interval_s)
        after = self._read()
        stopped, elsewhere = {}, {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            a, b = before[r], after[r]
            if b is None or (a is not None and a[0] == b[0]):
                stopped[r] = b[1] if b else "never started"
            elif b[1] != self._phase:
                elsewhere[r] = b[1]
        return stopped, elsewhere

    def explain(self, error: BaseException, timeout_minutes: float) -> str:
        """One message for a failed collective: what, where, and which ranks are missing."""
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        head = (
            f"rank {self.rank}: collective {collective_of(error)} failed during "
            f"'{self._phase}' (parallel.timeout_minutes={timeout_minutes:g}): {first_line}"
        )
        try:
            stopped, elsewhere = self.missing_ranks()
        except Exception as e:  # the store died with its host: say so, keep the first error
            return (
                f"{head}. The job's store is unreachable too ({type(e).__name__}): the "
                "process hosting it (rank 0 or the launcher) is gone."
            )
        parts = [head]
        for r, where in stopped.items():
            parts.append(f"rank {r} stopped responding (no heartbeat; last in '{where}')")
        for r, where in elsewhere.items():
            parts.append(f"rank {r} is alive but in '{where}'")
        if len(parts) == 1:
            parts.append("every rank is alive and in the same phase")
        return "; ".join(parts)
