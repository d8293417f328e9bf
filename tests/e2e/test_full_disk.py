"""A full disk during a save of 2 gloo ranks (EP=2, ZeRO-2) under torchrun and the real CLI.

The disk fills (``MOETRAIN_FAULT=...:ENOSPC``: the write raises ``OSError(ENOSPC)`` as a full
disk does) on every rank in the save of step 4, or on rank 0 alone while DeepSpeed copies its
``zero_to_fp32.py`` into the first checkpoint. Decided behaviour: the run stops on every rank
with one clear error naming the rank, the file and the errno; the failed checkpoint never
becomes complete (its directory is removed); the previous checkpoint stays the newest complete
one and loads: a restart resumes from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.checkpoint.format import verify_manifest
from tests.e2e.restarts import overrides, run, torchrun
from tests.helpers.launch import losses

pytestmark = pytest.mark.slow


def _job(data: list[str], run_dir: Path, fault: str, steps: int = 4):
    ov = overrides(data, **{"train.max_steps": str(steps)})
    return run(torchrun(run_dir, ov), MOETRAIN_FAULT=fault)


def _stopped_with(r, *phrases: str) -> str:
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    # no rank died with a traceback (the launcher's own report of the failed children aside)
    frames = [ln for ln in out.splitlines() if ln.strip().startswith('File "')]
    assert not [f for f in frames if "/deepspeed/" in f or "/moetrain/" in f], out[-3000:]
    for phrase in phrases:
        assert phrase in out, (phrase, out[-3000:])
    return out


def test_a_full_disk_on_every_rank_stops_cleanly_and_keeps_the_previous_checkpoint(
    tiny_data, tmp_path
):
    run_dir = tmp_path / "run"
    r = _job(tiny_data, run_dir, "save.write:0:4:ENOSPC,save.write:1:4:ENOSPC")
    _stopped_with(
        r,
        "checkpoint step_00000004 could not be written",
        "rank 0: writing",
        "rank 1: writing",
        "[Errno 28] No space left on device",
        "the newest complete checkpoint is step_00000002",
    )
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002"]
    verify_manifest(ckpts / "step_00000002")
    resumed = _job(tiny_data, run_dir, "")  # the disk has room again: resume from step 2
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_00000002'}" in resumed.stdout + resumed.stderr
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]


def test_a_full_disk_while_deepspeed_copies_its_scripts_is_the_same_clear_stop(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    r = _job(tiny_data, run_dir, "save.recovery_scripts:0:2:ENOSPC", steps=2)
    _stopped_with(
        r,
        "checkpoint step_00000002 could not be written",
        "rank 0: copying DeepSpeed's zero_to_fp32.py: [Errno 28] No space left on device",
        "the newest complete checkpoint is none",
    )
    assert list((run_dir / "checkpoints").glob("step_*")) == []
