"""What the per-rank memory benchmarks share: the process's memory figures, the reset of its
peak, and their ranks started under torchrun, each writing its figures to a file of its own.

Every rank runs one thread, and glibc returns freed blocks at once
(``MALLOC_MMAP_THRESHOLD_=65536``), so the resident set follows the live tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def status(key: str) -> int:
    """``key`` of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Reset the peak resident set (VmHWM) to the current one; -> the current one in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def write_result(out: str, rank: int, figures: dict) -> None:
    """A rank's figures, into ``out`` (the folder :func:`run_ranks` hands its workers)."""
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))


def run_ranks(script: str, nproc: int, args: list[str]) -> list[dict]:
    """Run ``script worker *args --out=DIR`` on ``nproc`` ranks under torchrun; -> each rank's
    figures (:func:`write_result`) by rank. Exits with the output's tail if a rank fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with tempfile.TemporaryDirectory() as out:
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", script, "worker", *args]
        proc = subprocess.run(
            [*cmd, f"--out={out}"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        if proc.returncode:
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nproc)]
