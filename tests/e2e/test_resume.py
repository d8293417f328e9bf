"""Resume and fault tolerance through torchrun and the real CLI (2 gloo ranks, EP=2, ZeRO-2).

The reference is one uninterrupted 10-step run (checkpoints every 2 steps, keep the last 2,
wandb offline with a sentinel WANDB_API_KEY). Every interrupted run must log exactly the
reference's losses, bit for bit: on CPU, DeepSpeed restores the fp32 weights and Adam states
exactly, the data position and per-rank RNG states are restored, and the kernels are
deterministic. The same holds in bf16 (its own uninterrupted reference): the checkpoint holds
the fp32 masters, and the bf16 weights are rounded from them as the live ones were.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from moetrain.checkpoint.format import verify_manifest
from moetrain.monitor.wandb_run import offline_run_dirs, read_run_records
from tests.e2e.restarts import (
    STEPS,
    kill_during_save,
    kill_worker_in_place,
    overrides,
    run,
    start,
    stop,
    torchrun,
    wait_for_step,
)
from tests.helpers.launch import CONFIG, PY, logged_losses, losses, rank_pid

pytestmark = pytest.mark.slow

BF16 = {"train.precision": "bf16"}
SENTINEL = "sentinel-wandb-key-0123456789abcdef"


def _steps_in_order(run_dir: Path) -> list[int]:
    return [s for s, _ in logged_losses(run_dir)]


@pytest.fixture(scope="module")
def data(tiny_data) -> list[str]:
    return tiny_data


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("resume-ref") / "run"
    ov = overrides(
        data, **{"logging.wandb.mode": "offline", "logging.wandb.respect_env_mode": "false"}
    )
    r = run(torchrun(run_dir, ov), WANDB_API_KEY=SENTINEL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    return run_dir


def test_retention_keeps_exactly_the_last_two(reference):
    names = sorted(p.name for p in (reference / "checkpoints").glob("step_*"))
    assert names == ["step_00000008", "step_00000010"]


def test_sentinel_api_key_is_nowhere_on_disk(reference):
    assert (reference / "wandb").is_dir()  # a real offline run was written
    hits = []
    for path in reference.rglob("*"):
        if path.is_file() and SENTINEL.encode() in path.read_bytes():
            hits.append(str(path))
    assert hits == []


def _history(run: Path) -> list[tuple[int, dict]]:
    records = read_run_records(run)
    return [
        (r["history"]["step"]["num"], r["history"]["item"])
        for r in records
        if r["type"] == "history"
    ]


def test_wandb_offline_run_from_rank_0_only(reference):
    runs = offline_run_dirs(reference)
    assert len(runs) == 1  # exactly one run for two ranks
    history = _history(runs[0])
    steps = [step for step, _ in history]
    assert steps == list(range(1, STEPS + 1))
    last = history[-1][1]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "perplexity",
        "perf/tflops_per_device",
        "moe/layer0/cv",
        "moe/layer1/dropped_frac",
        "moe/imbalance_max_over_mean",
        "moe/ep_max_over_mean",  # the reference runs at EP 2
    ):
        assert key in last, key


def test_report_renders_plots_of_a_real_run(reference, tmp_path):
    r = run([PY, "-m", "moetrain", "report", str(reference)])
    assert r.returncode == 0, r.stderr[-2000:]
    pngs = [Path(line) for line in r.stdout.split() if line.endswith(".png")]
    assert {p.name for p in pngs} >= {"loss.png", "lr.png", "expert_load.png"}
    assert all(p.stat().st_size > 5000 for p in pngs)


# The interruption scenarios below are independent of each other once the reference
# exists. Each runs in a thread of its own (its own launches one after another), two scenarios
# at a time, so that on 2 cores one scenario's start-ups fill the other's waits (more at once
# only adds contention). A scenario does the launches and the checks its next launch depends
# on; its test checks the rest.

# Killed inside the save of step 10: rank 1 with its files written and fsynced, before the ranks
# exchange their lists. Every point of moetrain.faults (before any file, between files, after
# the files, during the commit marker), one restart round each: tests/e2e/test_fault_loops.py.
SAVE_FAULTS = ["save.after_shards:1:10"]


def _sigterm_scenario(data: list[str], tmp_path: Path, **extra: str) -> tuple[Path, int, str]:
    run_dir = tmp_path / "run"
    ov = overrides(
        data,
        **{
            "checkpoint.save_every_steps": "100",
            "logging.wandb.mode": "offline",
            "logging.wandb.respect_env_mode": "false",
            **extra,
        },
    )
    log = tmp_path / "first.log"
    proc = start(torchrun(run_dir, ov), log)
    try:
        wait_for_step(run_dir, 3, proc, log)
        pid = rank_pid(proc.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=240) == 0, log.read_text()[-4000:]
    finally:
        stop(proc)
    out = log.read_text()
    assert "stopping at step" in out, out[-3000:]
    stopped = max(_steps_in_order(run_dir))
    assert 3 <= stopped < STEPS, stopped
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}" / "COMMITTED.json").is_file()
    r = run(torchrun(run_dir, ov))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir, stopped, r.stdout


def _bf16_scenario(data: list[str], tmp_path: Path) -> tuple[Path, Path, int]:
    """An uninterrupted bf16 run, then the SIGTERM scenario in bf16."""
    reference = tmp_path / "reference"
    r = run(torchrun(reference, overrides(data, **BF16)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir, stopped, _ = _sigterm_scenario(data, tmp_path / "interrupted", **BF16)
    return reference, run_dir, stopped


def _truncated_scenario(
    data: list[str], reference: Path, tmp_path: Path
) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    victim = next((run_dir / "checkpoints" / "step_00000010").glob("layer_0_expert_1_*.pt"))
    victim.write_bytes(victim.read_bytes()[:64])
    r = run(
        [
            PY,
            "-m",
            "moetrain",
            "train",
            CONFIG,
            *overrides(data),
            "parallel.ep_size=1",
            f"run_dir={run_dir}",
        ]
    )
    return victim, r


@pytest.fixture(scope="module")
def scenarios(request, data, reference, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """name -> the future outcome of that scenario; two scenarios run at a time. With -m long
    only: the bf16 one (three more launches; bf16 resume is also proven in-process by
    tests/distributed/test_precision.py) and the worker killed mid-run (two rounds of a whole
    job; the default suite's kill and in-place restart is the save's, and
    tests/e2e/test_fault_loops.py repeats this one ten times)."""
    full = "long" in (request.config.getoption("markexpr") or "")
    names = ("sigterm", "bf16", "crash", "save", "trunc")
    work = {name: tmp_path_factory.mktemp(name) for name in names}
    (work["bf16"] / "interrupted").mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            "save": pool.submit(kill_during_save, data, reference, work["save"], SAVE_FAULTS),
            "sigterm": pool.submit(_sigterm_scenario, data, work["sigterm"]),
            "trunc": pool.submit(_truncated_scenario, data, reference, work["trunc"]),
        }
        if full:
            futures["crash"] = pool.submit(kill_worker_in_place, data, work["crash"])
            futures["bf16"] = pool.submit(_bf16_scenario, data, work["bf16"])
        yield futures


def test_sigterm_to_one_rank_saves_everywhere_and_resume_matches(scenarios, reference):
    """SIGTERM to rank 1 once step 3 is logged: the job stops, commits a checkpoint of the step
    it stopped at and exits 0; the same command then resumes from it, logs the reference's
    losses bit for bit and continues the same wandb run."""
    run_dir, stopped, stdout = scenarios["sigterm"].result()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped:08d}'}" in stdout
    assert losses(run_dir) == losses(reference)  # bit for bit, every step
    first, second = offline_run_dirs(run_dir)  # the resumed run continues the same wandb run
    assert first.name.rsplit("-", 1)[1] == second.name.rsplit("-", 1)[1]
    assert [step for step, _ in _history(second)] == list(range(stopped + 1, STEPS + 1))


@pytest.mark.long
def test_bf16_sigterm_and_resume_match_the_uninterrupted_bf16_run(scenarios, reference):
    """SIGTERM to rank 1 of a bf16 run; the resumed run logs the uninterrupted bf16 run's losses
    bit for bit (and they are not the fp32 run's)."""
    bf16_reference, run_dir, stopped = scenarios["bf16"].result()
    assert 3 <= stopped < STEPS
    assert sorted(losses(bf16_reference)) == list(range(1, STEPS + 1))
    assert losses(run_dir) == losses(bf16_reference)
    assert losses(bf16_reference) != losses(reference)  # bf16 really ran
    ckpt = run_dir / "checkpoints" / f"step_{stopped:08d}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["config"]["train"]["precision"] == "bf16"


@pytest.mark.long
def test_killed_worker_restarts_in_place_and_matches(scenarios, reference):
    """``kill -9`` of rank 1 once step 5 is logged, under ``torchrun --max-restarts 1``:
    torchrun restarts both workers in the same job, they resume from the newest complete
    checkpoint, the job exits 0 and its losses equal the uninterrupted run's bit for bit."""
    run_dir, killed_at, code, out = scenarios["crash"].result()
    assert code == 0, out[-4000:]
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, out[-4000:]
    step = int(resumed[0].rsplit("(step ", 1)[1].rstrip(")"))
    newest = killed_at - killed_at % 2  # checkpoints every 2 steps
    # newest - 2 when the kill landed after step `newest` was logged, before it was committed
    assert step in (newest, newest - 2), (resumed, killed_at)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:08d}'}" in resumed[0]
    order = _steps_in_order(run_dir)
    assert any(b <= a for a, b in zip(order, order[1:], strict=False)), "no resume in the metrics"
    assert losses(run_dir) == losses(reference)


def test_kills_during_a_save_resume_from_the_previous_checkpoint(scenarios, reference):
    """A kill inside the save of step 10 (see SAVE_FAULTS) under ``torchrun --max-restarts``
    leaves a step-10 directory without its commit marker; the restarted round removes it,
    resumes from step 8, trains steps 9 and 10 again with the reference's losses and commits a
    complete step 10."""
    run_dir, r = scenarios["save"].result()
    out = r.stdout + r.stderr
    ckpts = run_dir / "checkpoints"
    assert r.returncode == 0, out[-4000:]
    assert [p.name for p in (run_dir.parent / "fired").iterdir()] == ["save.after_shards-1-10"]
    assert out.count(f"removed incomplete checkpoint {ckpts / 'step_00000010'}") == 1, out[-4000:]
    assert out.count(f"resumed from {ckpts / 'step_00000008'}") == 2, out[-4000:]
    ref = losses(reference)
    assert losses(run_dir) == {s: ref[s] for s in (9, 10)}
    assert [s for s, _ in logged_losses(run_dir)] == [9, 10] * 2
    verify_manifest(ckpts / "step_00000010")  # complete and intact
    assert not list((ckpts / "step_00000010").glob("*.tmp*"))


def test_truncated_file_in_a_committed_checkpoint_is_a_clear_error(scenarios):
    victim, r = scenarios["trunc"].result()
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert victim.name in r.stderr and "truncated" in r.stderr
