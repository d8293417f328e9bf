"""A hung rank ends the job, through torchrun and the real CLI (2 gloo ranks, EP=2, ZeRO-2).

Rank 1 stops itself with SIGSTOP (``MOETRAIN_FAULT``, :mod:`moetrain.faults`) inside the save of
step 2, after writing its files and before the ranks exchange their file lists. Rank 0 must give
up after ``parallel.timeout_minutes`` (6 s here), exit non-zero with a message naming the
collective it waited in and rank 1 as the one that stopped responding, and leave no commit
marker: the half-written checkpoint is not a checkpoint. (torchrun would then give the stopped
rank 30 s of grace before its SIGKILL; the test sends that SIGKILL at once.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.restarts import TORCHRUN, start, stop
from tests.helpers.launch import CONFIG, logged_losses, rank_pid

pytestmark = pytest.mark.slow

TIMEOUT_MIN = 0.1  # 6 s
MARGIN_S = 30  # the diagnosis (3 heartbeat intervals), the process exit, 2 busy cores


def test_sigstopped_rank_ends_the_job_naming_it(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "moetrain",
        "train",
        CONFIG,
        *tiny_data,
        "parallel.ep_size=2",
        "train.max_steps=6",
        "checkpoint.save_every_steps=2",
        f"parallel.timeout_minutes={TIMEOUT_MIN}",
        f"run_dir={run_dir}",
    ]
    log = tmp_path / "job.log"
    proc = start(cmd, log, MOETRAIN_FAULT="save.after_shards:1:2:SIGSTOP")
    try:
        end = time.monotonic() + 240
        while not any(s >= 2 for s, _ in logged_losses(run_dir)):
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.05)
        stopped_at = time.monotonic()  # rank 1 stops a moment later, inside the save
        rank0, rank1 = rank_pid(proc.pid, 0), rank_pid(proc.pid, 1)
        assert rank0 is not None and rank1 is not None
        while Path(f"/proc/{rank0}").exists() and time.monotonic() - stopped_at < 120:
            time.sleep(0.05)
        took = time.monotonic() - stopped_at
        # torchrun would give the stopped rank 30 s of grace before its SIGKILL: send it now
        os.kill(rank1, signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        stop(proc)  # the whole session: the stopped rank too
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert took < TIMEOUT_MIN * 60 + MARGIN_S, took
    # torchrun's report: rank 0 exited with 1 on its own
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: 1 ", text), text[-3000:]
    (msg,) = [line for line in text.splitlines() if "moetrain: error: rank 0: collective" in line]
    assert re.search(r"collective \w+ called from moetrain/checkpoint/checkpointer\.py:\d+", msg), (
        msg
    )
    assert "failed during 'checkpoint step_00000002: gather the ranks' file lists'" in msg, msg
    assert "rank 1 stopped responding (no heartbeat; last in '" in msg, msg
    assert "parallel.timeout_minutes=0.1" in msg
    partial = run_dir / "checkpoints" / "step_00000002"
    assert partial.is_dir() and not (partial / "COMMITTED.json").exists()
    assert max(s for s, _ in logged_losses(run_dir)) == 2  # nobody went on
