"""Fault injection at named points, for testing how moetrain survives faults.

Off unless ``MOETRAIN_FAULT`` is set to one or more comma-separated ``POINT:RANK:STEP[:SIGNAL]``:
each makes the process of global rank RANK send itself SIGNAL (default SIGKILL; SIGSTOP to
hang it) when it reaches POINT while saving, or starting, training step STEP. SIGNAL
``ENOSPC`` raises ``OSError(ENOSPC)`` there instead, as a full disk does in a write. With
``MOETRAIN_FAULT_ONCE=DIR`` each fault fires only once: it first creates a marker file in DIR
and does not fire when the marker exists, so that a restarted job runs through. Points:

- ``train.step``: at the start of training step STEP (before its batches are read);
- ``save.before_shards``: in a save, before this rank writes any file;
- ``save.between_shards``: after the first file this rank writes through DeepSpeed;
- ``save.write``: before each file this rank writes into the checkpoint (its own and DeepSpeed's);
- ``save.recovery_scripts``: rank 0, before DeepSpeed copies its ``zero_to_fp32.py`` scripts
  into the checkpoint;
- ``save.after_shards``: after this rank's files are written and fsynced, before the commit;
- ``save.commit``: rank 0, the commit marker written to its temporary name, not yet renamed.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

ENV = "MOETRAIN_FAULT"
ONCE_ENV = "MOETRAIN_FAULT_ONCE"
POINTS = (
    "train.step",
    "save.before_shards",
    "save.between_shards",
    "save.write",
    "save.recovery_scripts",
    "save.after_shards",
    "save.commit",
)
ENOSPC = "ENOSPC"
Fault = tuple[str, int, int, signal.Signals | str]


def parse(spec: str) -> list[Fault]:
    """``POINT:RANK:STEP[:SIGNAL][,...]`` -> the faults; a clear error for anything else."""
    out = []
    for one in spec.split(","):
        parts = one.strip().split(":")
        if len(parts) not in (3, 4) or parts[0] not in POINTS:
            raise ValueError(
                f"{ENV}={spec!r}: expected POINT:RANK:STEP[:SIGNAL] (comma-separated) with POINT "
                f"one of {POINTS}"
            )
        try:
            rank, step = int(parts[1]), int(parts[2])
            name = parts[3] if len(parts) == 4 else "SIGKILL"
            sig = ENOSPC if name == ENOSPC else signal.Signals[name]
        except (ValueError, KeyError):
            raise ValueError(
                f"{ENV}={spec!r}: RANK and STEP are integers, SIGNAL e.g. SIGSTOP or {ENOSPC}"
            ) from None
        out.append((parts[0], rank, step, sig))
    return out


def fault_point(point: str, rank: int, step: int) -> None:
    """Send the configured signal to this process (or raise the full disk's OSError) if
    ``MOETRAIN_FAULT`` names this place."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for want, want_rank, want_step, sig in parse(spec):
        if (want, want_rank, want_step) != (point, rank, step):
            continue
        once = os.environ.get(ONCE_ENV)
        if once:
            Path(once).mkdir(parents=True, exist_ok=True)
            try:
                (Path(once) / f"{point}-{rank}-{step}").touch(exist_ok=False)
            except FileExistsError:
                return
        if sig == ENOSPC:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{point} (injected)")
        os.kill(os.getpid(), sig)
