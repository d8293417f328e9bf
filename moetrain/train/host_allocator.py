"""glibc's allocator for a training process that computes on the CPU.

Two habits of glibc's malloc cost a CPU training process memory or time:

- Arenas. Every thread that allocates gets an arena of its own (up to 8 per core), and each arena
  keeps what was freed in it. gloo runs collectives on its worker threads, which allocate and free
  bucket-sized buffers every step; the training thread cannot reuse that memory, so each arena
  holds its own high-water mark. Both modes below give every thread the same arena.
- Mapped blocks. An allocation above the mmap threshold (at most 32 MiB) gets a fresh ``mmap``
  and is unmapped when freed, so a buffer of that size made every step (the loss's logits block,
  DeepSpeed's gradient partition) is faulted in and zeroed by the kernel every step, and freed
  heap tops are trimmed back to the system to be faulted in again. ``keep`` (the default)
  serves every allocation from the heap and never trims it, so the next step reuses the blocks
  as they are; ``one_arena`` leaves this habit alone: a little less peak memory, slower steps.
  Measured through ``moetrain train`` at the benchmark shape (benchmarks/results/training.md): against
  glibc's defaults, ``keep`` 20 MiB less peak memory per rank and 1.05-1.11x the tokens/s,
  ``one_arena`` 40 MiB less and no faster.
- Long-lived blocks among the heap's. The buffers a run keeps (the flat weights, the optimizer's
  state, ZeRO's gradient partition) are made while the model and engine are built and during the
  first step, between blocks that are freed again; on a heap that never shrinks each one then
  strands the holes below it, and the steps' large blocks (the loss's logits) need new room
  above. So ``keep`` maps every block of at least :data:`SETTLE_MMAP_THRESHOLD` on its own until
  :func:`settle_host_allocator` is called, after the first step: what lives on stays outside the
  heap, what was freed went back to the system, and from then on every block comes from the
  heap as above (the steps' time is unchanged). At the benchmark shape with EP=1 this takes
  about 50 MiB off the peak per rank.

Only where it applies: Linux with glibc, when ``moetrain train`` computes on the CPU (a GPU's step
allocates on the device), before any process group starts its threads. A ``MALLOC_*`` or
``GLIBC_TUNABLES`` setting in the environment wins over both (nothing is changed); ``system``
changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MODES", "SETTLE_MMAP_THRESHOLD", "settle_host_allocator", "tune_host_allocator"]

MODES = ("keep", "one_arena", "system")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER = 2**31 - 1  # largest value mallopt takes: no trim below ~2 GiB of free heap top
SETTLE_MMAP_THRESHOLD = 2**20
"""``keep``: the size from which a block is mapped on its own until the run settles (bytes)."""
_MAPPED_BLOCKS = 2**16  # glibc's default M_MMAP_MAX
_unsettled = {"mallopt": None}  # keep's mallopt until settle_host_allocator has run


def _environment_setting() -> str | None:
    return next(
        (n for n in sorted(os.environ) if n.startswith("MALLOC_") or n == "GLIBC_TUNABLES"), None
    )


def tune_host_allocator(mode: str) -> str | None:
    """Apply ``mode`` (:data:`MODES`) to this process's glibc malloc; -> a line saying what was
    done, or None for ``system``."""
    if mode not in MODES:
        raise ValueError(f"host allocator mode must be one of {MODES}; got {mode!r}")
    if mode == "system":
        return None
    if not sys.platform.startswith("linux"):
        return "host allocator: left as it is (not Linux)"
    setting = _environment_setting()
    if setting is not None:
        return f"host allocator: left as it is ({setting} is set in the environment)"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "host allocator: left as it is (no glibc)"
    options = [(_M_ARENA_MAX, 1)]
    if mode == "keep":
        options += [
            (_M_MMAP_THRESHOLD, SETTLE_MMAP_THRESHOLD),
            (_M_MMAP_MAX, _MAPPED_BLOCKS),
            (_M_TRIM_THRESHOLD, _NEVER),
        ]
    if not all(mallopt(option, value) for option, value in options):
        return "host allocator: glibc refused a setting"
    if mode == "keep":
        _unsettled["mallopt"] = mallopt
        return "host allocator: one malloc arena; freed memory kept on the heap for reuse"
    return "host allocator: one malloc arena for every thread"


def settle_host_allocator() -> bool:
    """After the first training step under ``keep``: every block from the heap from now on
    (module docstring); -> whether anything changed (False elsewhere, and once done)."""
    mallopt = _unsettled["mallopt"]
    if mallopt is None:
        return False
    _unsettled["mallopt"] = None
    return bool(mallopt(_M_MMAP_MAX, 0))
