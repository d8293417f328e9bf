"""A rollback through the real CLI: ``checkpoint.resume=PATH`` to an older checkpoint of the same
run starts a new timeline, and the same command started again continues it.

Run A saves steps 2, 4 and 6 (the last 2 kept: 4 and 6). Run B rolls back to step 4 under
``torchrun --max-restarts 1``, saves every step and is killed at the start of step 7
(``MOETRAIN_FAULT``, once); torchrun starts the same command again, which must continue B's
timeline from its step 6 (losing nothing: the kill came right after a save), not roll back to
step 4 again. The abandoned step 6 must survive untouched outside the live timeline, B's own
checkpoints must survive retention, and B must log the losses an uninterrupted rollback run
logs (the same rollback from a copy of A's checkpoints, without the kill).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from moetrain.checkpoint.format import COMMIT_FILE, verify_manifest
from moetrain.checkpoint.timeline import read_timelines
from tests.e2e.restarts import TORCHRUN
from tests.helpers.launch import CONFIG, PY, ROOT, env_for, logged_losses, losses

pytestmark = pytest.mark.slow


def _train(
    run_dir: Path, data: list[str], *extra: str, launcher: list[str] = (PY,), **env: str
) -> subprocess.CompletedProcess:
    cmd = [*launcher, "-m", "moetrain", "train", CONFIG, *data, f"run_dir={run_dir}"]
    cmd += ["parallel.ep_size=1", "train.micro_batch_size=2", "checkpoint.keep_last=2", *extra]
    return subprocess.run(
        cmd, env=env_for(**env), cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_rollback_keeps_the_abandoned_timeline_and_a_restart_continues_the_new_one(
    tiny_data, tmp_path
):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    _ok(_train(run, tiny_data, "train.max_steps=6", "checkpoint.save_every_steps=2"))
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000006"]
    abandoned_manifest = (ckpts / "step_00000006" / COMMIT_FILE).read_bytes()
    # the uninterrupted rollback below starts from the same checkpoints (run A, as it is now)
    reference = tmp_path / "reference"
    shutil.copytree(ckpts, reference / "checkpoints")
    abandoned_loss_6 = losses(run)[6]
    logged_before = len(logged_losses(run))

    # the new timeline trains differently (another learning rate), so the timelines differ
    rollback = [f"checkpoint.resume={ckpts / 'step_00000004'}", "optim.lr=1e-3"]
    rollback.append("checkpoint.save_every_steps=1")
    restarted = _train(
        run,
        tiny_data,
        "train.max_steps=8",
        *rollback,
        launcher=[TORCHRUN, "--standalone", "--nproc_per_node", "1", "--max-restarts", "1"],
        MOETRAIN_FAULT="train.step:0:7",
        MOETRAIN_FAULT_ONCE=str(tmp_path / "fired"),
    )
    out = _ok(restarted)
    assert [p.name for p in (tmp_path / "fired").iterdir()] == ["train.step-0-7"]  # killed once
    moved = ckpts / "abandoned" / "after_step_4"
    assert out.count("rollback to step 4") == 1 and f"moved to {moved}" in out, out[-3000:]
    assert [p.name for p in (ckpts / "abandoned").iterdir()] == ["after_step_4"]
    # the restart continued the timeline from its newest checkpoint: nothing redone
    assert f"continuing it from its newest checkpoint {ckpts / 'step_00000006'}" in out
    assert [s for s, _ in logged_losses(run)][logged_before:] == [5, 6, 7, 8]
    # the abandoned step 6 is intact and complete, outside the live timeline
    assert (moved / "step_00000006" / COMMIT_FILE).read_bytes() == abandoned_manifest
    verify_manifest(moved / "step_00000006")
    # the new timeline's checkpoints survived retention (keep_last=2), and it is recorded
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000007", "step_00000008"]
    (timeline,) = read_timelines(ckpts)
    assert (timeline["start"], timeline["step"]) == (str(ckpts / "step_00000004"), 4)

    # the same rollback uninterrupted, from run A's checkpoints: B continued its own timeline
    # exactly
    rollback = [f"checkpoint.resume={reference / 'checkpoints' / 'step_00000004'}", "optim.lr=1e-3"]
    _ok(_train(reference, tiny_data, "train.max_steps=8", *rollback))
    got, want = losses(run), losses(reference)
    assert [got[s] for s in (5, 6, 7, 8)] == [want[s] for s in (5, 6, 7, 8)]
    assert got[6] != abandoned_loss_6  # and it is not the abandoned timeline's
