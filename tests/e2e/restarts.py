"""Jobs of 2 gloo ranks (EP=2, ZeRO-2) under ``torchrun --standalone`` through the real CLI, and
the faults the resume tests put them through: a worker killed under ``--max-restarts`` and a
rank killed inside a save (``MOETRAIN_FAULT``, :mod:`moetrain.faults`).

Every job is :data:`STEPS` steps, a checkpoint every 2 steps, the last 2 kept; its losses are
compared with an uninterrupted run of the same command (the tests' ``reference``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers.launch import CONFIG, PY, ROOT, env_for, logged_losses, rank_pid

STEPS = 10
TORCHRUN = str(Path(PY).parent / "torchrun")


def overrides(data: list[str], **extra: str) -> list[str]:
    """The prepared data's overrides plus the jobs' settings (``extra`` wins)."""
    ov = {
        "parallel.ep_size": "2",
        "parallel.zero_stage": "2",
        "train.max_steps": str(STEPS),
        "train.micro_batch_size": "2",
        "checkpoint.save_every_steps": "2",
        "checkpoint.keep_last": "2",
    }
    ov.update(extra)
    return [*data, *(f"{k}={v}" for k, v in ov.items())]


def torchrun(run_dir: Path, ov: list[str], *launcher_args: str) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",  # c10d rendezvous: a restarted round can rendezvous again
        "--nproc_per_node",
        "2",
        *launcher_args,
        "-m",
        "moetrain",
        "train",
        CONFIG,
        *ov,
        f"run_dir={run_dir}",
    ]


def run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, env=env_for(**env), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Start a launcher in its own session, so :func:`stop` can end it with its workers."""
    fh = log.open("w")
    return subprocess.Popen(
        cmd,
        env=env_for(**env),
        cwd=ROOT,
        stdout=fh,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + 240
    while not any(s >= step for s, _ in logged_losses(run_dir)):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < end, log.read_text()[-4000:]
        time.sleep(0.05)


def kill_worker_in_place(
    data: list[str], tmp_path: Path, after_step: int = 5, rank: int = 1
) -> tuple[Path, int, int, str]:
    """``kill -9`` of worker ``rank`` once ``after_step`` is logged, under ``torchrun
    --max-restarts 1``; -> (run_dir, last step logged before the kill, torchrun's exit code,
    its output)."""
    run_dir = tmp_path / "run"
    log = tmp_path / "inplace.log"
    proc = start(torchrun(run_dir, overrides(data), "--max-restarts", "1"), log)
    try:
        wait_for_step(run_dir, after_step, proc, log)
        pid = rank_pid(proc.pid, rank)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed_at = max(s for s, _ in logged_losses(run_dir))
        code = proc.wait(timeout=300)
    finally:
        stop(proc)
    assert killed_at < STEPS, "the run ended before the kill: make it longer"
    return run_dir, killed_at, code, log.read_text()


def kill_during_save(
    data: list[str], reference: Path, tmp_path: Path, faults: list[str]
) -> tuple[Path, subprocess.CompletedProcess]:
    """Start from a copy of the reference's step-8 checkpoint under ``torchrun --max-restarts
    len(faults)``, each fault (``POINT:RANK:10``) firing once, in order, in the save of step 10.
    -> (run_dir, the finished launch)."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_00000008", ckpts / "step_00000008")
    cmd = torchrun(run_dir, overrides(data), "--max-restarts", str(len(faults)))
    r = run(
        cmd,
        timeout=600,
        MOETRAIN_FAULT=",".join(faults),
        MOETRAIN_FAULT_ONCE=str(tmp_path / "fired"),
    )
    return run_dir, r
