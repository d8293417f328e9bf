"""Fault injection at named points, for testing how moetrain survives faults.

Off unless ``MOETRAIN_FAULT`` is set: ``POINT:RANK:STEP[:SIGNAL]`` makes the process of global
rank RANK send itself SIGNAL (default SIGKILL; SIGSTOP to hang it) when it reaches POINT while
saving or training step STEP. With ``MOETRAIN_FAULT_ONCE=PATH`` the fault fires only if PATH
does not exist, and creates it first, so that a restarted job runs through. Points:

- ``save.before_shards``: in a save, before this rank writes any file;
- ``save.between_shards``: after the first file this rank writes through DeepSpeed;
- ``save.after_shards``: after this rank's files are written and fsynced, before the commit;
- ``save.commit``: rank 0, the commit marker written to its temporary name, not yet renamed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "MOETRAIN_FAULT"
ONCE_ENV = "MOETRAIN_FAULT_ONCE"
POINTS = ("save.before_shards", "save.between_shards", "save.after_shards", "save.commit")


def parse(spec: str) -> tuple[str, int, int, signal.Signals]:
    """``POINT:RANK:STEP[:SIGNAL]`` -> its parts; a clear error for anything else."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[0] not in POINTS:
        raise ValueError(
            f"{ENV}={spec!r}: expected POINT:RANK:STEP[:SIGNAL] with POINT one of {POINTS}"
        )
    try:
        rank, step = int(parts[1]), int(parts[2])
        sig = signal.Signals[parts[3]] if len(parts) == 4 else signal.SIGKILL
    except (ValueError, KeyError):
        raise ValueError(
            f"{ENV}={spec!r}: RANK and STEP are integers, SIGNAL e.g. SIGSTOP"
        ) from None
    return parts[0], rank, step, sig


def fault_point(point: str, rank: int, step: int) -> None:
    """Send the configured signal to this process if ``MOETRAIN_FAULT`` names this place."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, want_rank, want_step, sig = parse(spec)
    if (want, want_rank, want_step) != (point, rank, step):
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:
            Path(once).touch(exist_ok=False)
        except FileExistsError:
            return
    os.kill(os.getpid(), sig)
