"""Training on a three-source mixture through the real CLI: per-source metrics in
metrics.jsonl (``data/tokens/<name>``, ``data/epochs/<name>``, ``val/loss/<name>``) and the
report's plots, and an exact resume: SIGTERM mid-run, the same command again, the uninterrupted
run's losses bit for bit; with ``-m long``, a resume on two data-parallel ranks of a run
stopped on one process. (The loader alone resumed on another number of ranks:
tests/distributed/test_blend_processes.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.configs import cli_args
from tests.helpers.corpus import run_prepare, write_stdlib_corpus, write_words_corpus
from tests.helpers.launch import CONFIG, PY, ROOT, env_for, logged_losses, losses

pytestmark = pytest.mark.slow

STEPS = 8
NAMES = ("words", "code", "tiny")
WEIGHTS = (0.6, 0.3, 0.1)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("mixture")
    words = write_words_corpus(tmp / "words.txt", docs=400)
    code = write_stdlib_corpus(tmp / "code.txt", 6, 150_000)
    tiny = write_words_corpus(tmp / "tiny.txt", docs=12, words=50)
    sources = [
        {"source": str(p), "weight": w, "name": n}
        for p, w, n in zip((words, code, tiny), WEIGHTS, NAMES, strict=True)
    ]
    ov = cli_args(
        {"data.sources": json.dumps(sources), "data.output_dir": str(tmp / "data")},
        parallel__ep_size=1,
        train__max_steps=STEPS,
        train__micro_batch_size=4,
        train__eval_every=4,
        train__eval_steps=1,
        checkpoint__save_every_steps=100,
    )
    run_prepare(CONFIG, ov)
    return ov


def _train(ov: list[str], run_dir: Path) -> list[str]:
    return [PY, "-m", "moetrain", "train", CONFIG, *ov, f"run_dir={run_dir}"]


def _uninterrupted(ov: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        _train(ov, run_dir), env=env_for(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _interrupted(ov: list[str], run_dir: Path) -> tuple[int, subprocess.CompletedProcess]:
    log = run_dir.parent / "first.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(_train(ov, run_dir), env=env_for(), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            end = time.monotonic() + 240
            while not any(s >= 3 for s, _ in logged_losses(run_dir)):
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < end, log.read_text()[-3000:]
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stopped = max(s for s, _ in logged_losses(run_dir))
    return stopped, _uninterrupted(ov, run_dir)


@pytest.fixture(scope="module")
def runs(mixture, tmp_path_factory) -> dict:
    """The uninterrupted run and the interrupted + resumed one, side by side."""
    ref, cut = tmp_path_factory.mktemp("ref") / "run", tmp_path_factory.mktemp("cut") / "run"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_uninterrupted, mixture, ref)
        second = pool.submit(_interrupted, mixture, cut)
        r = first.result()
        stopped, resumed = second.result()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return {"ref": ref, "cut": cut, "stopped": stopped, "resumed": resumed}


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def test_per_source_metrics_and_report(runs):
    ref = runs["ref"]
    rows = _rows(ref)
    steps = [r for r in rows if "loss" in r]
    tokens_per_step = 4 * 64  # micro-batch 4 x seq_len 64, one rank
    for row in steps:
        per = [row[f"data/tokens/{n}"] for n in NAMES]
        assert sum(per) == row["step"] * tokens_per_step
        n = row["step"] * 4  # samples so far: each source within one sample of its share
        for tokens, w in zip(per, WEIGHTS, strict=True):
            assert abs(tokens / 64 - w * n) < 1
    last = steps[-1]
    assert 0 < last["data/epochs/words"] < last["data/epochs/code"] < last["data/epochs/tiny"]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    for row in evals:
        per = {n: row[f"val/loss/{n}"] for n in NAMES}
        assert row["val_loss"] == pytest.approx(
            sum(w * per[n] for n, w in zip(NAMES, WEIGHTS, strict=True))
        )
    r = subprocess.run([PY, "-m", "moetrain", "report", str(ref)], env=env_for(), cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert {"data_tokens.png", "val_loss_sources.png"} <= {Path(x).name for x in r.stdout.split()}


def test_sigterm_and_resume_give_the_same_losses(runs):
    stopped, resumed = runs["stopped"], runs["resumed"]
    assert 3 <= stopped < STEPS
    assert f"resumed from {runs['cut'] / 'checkpoints' / f'step_{stopped:08d}'}" in resumed.stdout
    assert losses(runs["cut"]) == losses(runs["ref"])  # bit for bit, every step
    last = {n: _rows(runs["cut"])[-2].get(f"val/loss/{n}") for n in NAMES}
    want = {n: _rows(runs["ref"])[-2].get(f"val/loss/{n}") for n in NAMES}
    assert last == want


def _per_step(run_dir: Path) -> dict[int, dict]:
    """step -> its metrics record (the last record of a step wins)."""
    return {r["step"]: r for r in _rows(run_dir) if "loss" in r and "step" in r}


@pytest.mark.long  # three training runs, one on two ranks: minutes on 2 cores
def test_resume_on_two_ranks_continues_every_source(mixture, tmp_path):
    """Stopped after 4 steps on one process (grad_accum 2), resumed under torchrun on two
    data-parallel ranks (grad_accum 1, the same global batch; a constant learning rate, so the
    shorter first run's schedule is the same): every later step trains on as many samples of
    every source as the uninterrupted one-process run, on the same samples: step 5's loss
    (the same weights) is the uninterrupted run's exactly, later steps' within the
    layout-parity tolerance."""
    one = [*mixture, "optim.schedule=constant", "train.grad_accum_steps=2"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(_uninterrupted, one, ref)
        first = pool.submit(_uninterrupted, [*one, "train.max_steps=4"], cut)
        for r in (whole.result(), first.result()):
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = [*mixture, "optim.schedule=constant", "train.grad_accum_steps=1"]
    torchrun = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    cmd = [*torchrun, "-m", "moetrain", "train", CONFIG, *two, f"run_dir={cut}"]
    r = subprocess.run(cmd, env=env_for(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {cut / 'checkpoints' / 'step_00000004'}" in r.stdout + r.stderr
    want, got = _per_step(ref), _per_step(cut)
    assert sorted(got) == list(range(1, STEPS + 1))
    tokens = [f"data/tokens/{n}" for n in NAMES]
    for step in got:  # steps 1-4 on one process, 5-8 on two ranks
        assert [got[step][k] for k in tokens] == [want[step][k] for k in tokens], step
    assert got[5]["ce_loss"] == want[5]["ce_loss"]
    for step in (6, 7, 8):
        assert got[step]["ce_loss"] == pytest.approx(want[step]["ce_loss"], rel=1e-5), step
