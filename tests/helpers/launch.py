"""Helpers for tests that start the real CLI and launchers: paths, a clean environment for them,
the metrics a run writes, and its rank processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository, where every launch starts
CONFIG = str(ROOT / "configs/tiny-cpu.yaml")  # the shipped config the CLI tests start from
PY = sys.executable


def env_for(**extra: str) -> dict[str, str]:
    """The current environment without launcher/SLURM variables, one thread per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NPROC", "NNODES"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHON=PY, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (the last record of a step wins)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "step" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every (step, loss) record in order, repeats included (a resumed run logs steps again)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r and "step" in r]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(d.name))
    return kids


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker with RANK=rank among the launcher's children."""
    for pid in child_pids(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None
