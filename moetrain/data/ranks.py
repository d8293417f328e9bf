"""The ranks of a distributed ``moetrain prepare``, and how they wait for each other.

A prepare runs as one plain process or as many ranks over many nodes, under any launcher; the
rank comes from the environment: ``RANK`` / ``WORLD_SIZE`` (torchrun, deepspeed, accelerate),
else ``SLURM_PROCID`` / ``SLURM_STEP_NUM_TASKS`` (a task of an ``srun`` step), else one rank.

The ranks share nothing but the filesystem that holds the output (which every node of a
training job reads anyway): no process group, no network rendezvous. Work is handed over in
files written atomically; a rank that waits for another's files checks that the other is alive
through its heartbeat, a file the other touches every few seconds. A waiting rank compares the
file's modification time with the one it saw before, timed by its own clock, so clock skew
between nodes and the file server does not matter; a heartbeat unchanged for
``parallel.timeout_minutes`` means the rank has stopped, and the wait fails with its name.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from moetrain.data.errors import DataError
from moetrain.rank_env import RankEnvError, read_rank_env

HEARTBEAT_DIR = "heartbeat"
_BEAT_S = 2.0
# a waiting rank looks again after at most _POLL_S while a wait is young (a file of another rank
# is usually a moment away: the plan, the next chunk), after at most _POLL_LONG_S once it has
# lasted _YOUNG_S (light on a shared filesystem's metadata server when many ranks wait long)
_POLL_S, _POLL_LONG_S, _YOUNG_S = 0.02, 0.25, 5.0


@dataclass(frozen=True)
class Ranks:
    """This process's rank among the ``world`` ranks of a prepare; ``local_world`` of them share
    this node's cores."""

    rank: int = 0
    world: int = 1
    local_world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Ranks:
        """The rank and world size the launcher (or an ``srun`` step) announces
        (:mod:`moetrain.rank_env`; one rank without either)."""
        try:
            found = read_rank_env(env, srun=True)
        except RankEnvError as e:
            raise DataError(str(e)) from None
        return cls(found.rank, found.world_size, found.local_world_size)


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_num_proc(num_proc: int, ranks: Ranks | None = None) -> int:
    """``data.num_proc``, or for 0 this rank's share of the node's cores."""
    if num_proc > 0:
        return num_proc
    return max(1, cores() // (ranks.local_world if ranks else 1))


class RankStopped(DataError):
    """Another rank stopped while this one waited for it (a rerun continues the work)."""


class Heartbeat:
    """``with Heartbeat(directory, rank):`` touches ``directory/heartbeat/rank-<r>`` every few
    seconds from a background thread, so that other ranks can tell this one is alive."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = Path(directory) / HEARTBEAT_DIR / f"rank-{rank}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prepare-heartbeat", daemon=True)

    def _beat(self) -> None:
        try:  # never recreates a build directory that rank 0 has removed
            self.path.parent.mkdir(exist_ok=True)
            self.path.touch()
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(_BEAT_S):
            self._beat()

    def __enter__(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Watch:
    """Waits for files of other ranks while those ranks' heartbeats in ``directory`` move."""

    def __init__(self, directory: Path, timeout_s: float) -> None:
        self.directory = Path(directory) / HEARTBEAT_DIR
        self.timeout_s = timeout_s
        self._seen: dict[int, tuple[int | None, float]] = {}
        self._gone = False

    def alive(self, rank: int) -> bool:
        """False once rank's heartbeat has not changed for the timeout (or never appeared), or
        has gone (the build directory was removed: that rank failed on bad input)."""
        if not self.directory.parent.is_dir():  # removed, perhaps before any heartbeat was seen
            self._gone = True
            return False
        try:
            mtime: int | None = (self.directory / f"rank-{rank}").stat().st_mtime_ns
        except OSError:
            mtime = None
        now = time.monotonic()
        last = self._seen.get(rank)
        if last is not None and last[0] is not None and mtime is None:
            self._seen[rank] = (None, now)
            self._gone = True
            return False
        if last is None or last[0] != mtime:
            self._seen[rank] = (mtime, now)
            return True
        return now - last[1] < self.timeout_s

    def until(self, ready: Callable[[], bool], ranks: Iterable[int], what: str) -> None:
        """Return once ``ready()``; raise if one of ``ranks`` stops first."""
        ranks = list(ranks)
        delay, start = 0.002, time.monotonic()
        while not ready():
            for r in ranks:
                if not self.alive(r):
                    if self._gone:
                        raise DataError(
                            f"prepare: rank {r} stopped and removed {self.directory.parent} while "
                            f"this rank waited for {what}: see rank {r}'s error"
                        )
                    state = "stopped" if self._seen[r][0] is not None else "never started"
                    raise RankStopped(
                        f"prepare: rank {r} {state} (no heartbeat in {self.directory} for "
                        f"{self.timeout_s:.0f}s, parallel.timeout_minutes) while this rank waited "
                        f"for {what}; rerun the prepare on every rank: finished work is kept"
                    )
            time.sleep(delay)
            young = time.monotonic() - start < _YOUNG_S
            delay = min(delay * 1.5, _POLL_S if young else _POLL_LONG_S)
