"""Each launcher in launch/ starts a real 2-process training run (CPU, gloo, EP=2).

All runs read the same prepared shards with the same global batch (2 ranks x micro-batch 2,
or one plain process with micro-batch 4), so their per-step losses must agree with the plain
single-process run: an end-to-end layout-parity check through the real CLI and data pipeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.corpus import prepare_stdlib_config
from tests.helpers.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
STEPS = 3
CONFIG = {  # on the tiny model
    "seed": 3,
    "model.vocab_size": 384,
    "model.dense_hidden": 64,
    "model.max_seq_len": 32,
    "moe.expert_hidden": 32,
    "moe.bias_update_rate": 0.001,
    "data.source_format": "text",
    "data.seq_len": 32,
    "data.num_proc": 1,
    "data.val_fraction": 0.05,
    "parallel.ep_size": 2,
    "parallel.zero_stage": 2,
    "optim.lr": 3.0e-3,
    "optim.warmup_steps": 1,
    "optim.grad_clip": 0.5,
    "train.max_steps": STEPS,
    "train.micro_batch_size": 2,
    "train.eval_every": 3,
    "train.eval_steps": 1,
    "train.log_every": 1,
    "checkpoint.save_every_steps": 0,
}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHON=PY, PYTHONUNBUFFERED="1", **extra)
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config over a small prepared corpus (Python's own standard-library sources)."""
    work = tmp_path_factory.mktemp("launch")
    return prepare_stdlib_config(work, CONFIG, n_files=20, max_chars=400_000)


def _check(run: tuple[int, str, Path]) -> list[dict]:
    """A finished run (exit code, output, run_dir) -> its metrics records, checked."""
    code, out, run_dir = run
    assert code == 0, out[-4000:]
    assert f"step {STEPS}/{STEPS}" in out, out[-4000:]
    if sys.platform.startswith("linux"):  # the CPU run tuned glibc's allocator before it started
        assert "host allocator: one malloc arena; freed memory kept on the heap" in out, out[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ds = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2
    return records


def _loads(record: dict, layer: int) -> list[float]:
    """Tokens per expert of one MoE layer in a metrics.jsonl step record."""
    return record[f"moe/layer{layer}/tokens_per_expert"]


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r and "step" in r]


LAUNCHERS = {
    "torchrun": ["bash", "launch/train-torchrun.sh"],
    "deepspeed": ["bash", "launch/train-deepspeed.sh"],
    "accelerate": ["bash", "launch/train-accelerate.sh"],
}


@pytest.fixture(scope="module")
def runs(config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """The plain process ("single") and every launcher's 2-process run, all started at once (on 2
    cores their start-ups overlap each other's waits); name -> (exit code, output, run_dir)."""
    work = tmp_path_factory.mktemp("runs")
    ports: set[int] = set()
    while len(ports) < len(LAUNCHERS):  # a port of its own for every launcher
        ports.add(free_port())
    plain = [PY, "-m", "moetrain", "train", str(config)]
    cmds = {
        "single": ([*plain, "parallel.ep_size=1", "train.micro_batch_size=4"], _env()),
        **{
            name: ([*cmd, str(config)], _env(MASTER_PORT=str(port), NPROC="2"))
            for (name, cmd), port in zip(LAUNCHERS.items(), sorted(ports), strict=True)
        },
    }
    procs = {}
    for name, (cmd, env) in cmds.items():
        run_dir = work / name
        log = (work / f"{name}.log").open("w")
        cmd = [*cmd, f"run_dir={run_dir}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs[name] = (proc, log, run_dir)
    out = {}
    try:
        for name, (proc, log, run_dir) in procs.items():
            code = proc.wait(timeout=420)
            log.close()
            out[name] = (code, (work / f"{name}.log").read_text(errors="replace"), run_dir)
    finally:
        for proc, log, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return out


@pytest.fixture(scope="module")
def single(runs: dict[str, tuple]) -> list[dict]:
    records = _check(runs["single"])
    assert records[0]["step"] == 1 and len(_losses(records)) == STEPS
    return records


def test_plain_process(single: list[dict]) -> None:
    assert any("val_loss" in r for r in single)
    assert [sum(_loads(single[0], i)) for i in (0, 1)] == [4 * 32 * 2] * 2
    assert not any(key.startswith("comm/") for key in single[0])  # no all-to-all at EP=1


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_launcher_two_processes(launcher: str, runs: dict[str, tuple], single: list[dict]) -> None:
    records = _check(runs[launcher])
    losses, want = _losses(records), _losses(single)
    assert len(losses) == STEPS
    for got, ref in zip(losses, want, strict=True):
        assert abs(got - ref) / ref < 1e-5, (launcher, losses, want)
    # tokens per expert are global counts: 2 layers x 4 experts summing to tokens x top_k
    tokens = 4 * 32 * 2
    assert [sum(_loads(records[0], i)) for i in (0, 1)] == [tokens, tokens]
    # the expert all-to-alls, summed over ranks and the 2 MoE layers: a row per token and
    # destination rank (1 or 2 of them with top-2), some to the other rank, none to another node
    rec = records[0]
    assert 2 * 4 * 32 <= rec["comm/a2a_rows"] <= 2 * tokens
    assert 0 < rec["comm/a2a_rows_off_rank"] < rec["comm/a2a_rows"]
    assert rec["comm/a2a_bytes_off_rank"] > rec["comm/a2a_rows_off_rank"] * 4 * 32
    assert rec["comm/a2a_rows_off_node"] == rec["comm/a2a_bytes_off_node"] == 0
