"""Sequence parallelism through ``moetrain train`` (torchrun, 2 gloo ranks, sp=2 x ep=2 on the
same ranks) on a prepared corpus with packed documents (``data.document_mask``): the loader
hands both ranks the same rows (its data-parallel rank is ``rank // sp_size``), so the run sees
the global batch of one plain process at the same micro-batch, and its losses, gradient norms,
tokens and validation loss equal that process's. Its checkpoint records ``sp_size`` and resumes
at any: at sp=2 bit for bit the uninterrupted run, at sp=1 (the same 2 ranks, ep=2) the one
process's run to 1e-5.
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
STEPS = 4  # checkpoints at 2 and 4; the resumed runs start at 2
CONFIG = {
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
    "data.document_mask": True,
    "parallel.ep_size": 1,
    "parallel.zero_stage": 2,
    "parallel.timeout_minutes": 2,
    "optim.lr": 3.0e-3,
    "optim.warmup_steps": 1,
    "optim.grad_clip": 0.5,
    "train.max_steps": STEPS,
    "train.micro_batch_size": 2,
    "train.eval_every": STEPS,
    "train.eval_steps": 1,
    "train.log_every": 1,
    "checkpoint.save_every_steps": STEPS // 2,
}
REL = 1e-5


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _torchrun(*args: str) -> list[str]:
    port = f"--master_port={free_port()}"
    return [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", port, "-m", "moetrain", *args]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(cmds: dict[str, list[str]], work: Path) -> dict[str, tuple[int, str]]:
    procs = {}
    for name, cmd in cmds.items():
        log = (work / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=log), log)
    out = {}
    try:
        for name, (proc, log) in procs.items():
            code = proc.wait(timeout=420)
            log.close()
            out[name] = (code, (work / f"{name}.log").read_text(errors="replace"))
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return out


def _close(one: list[dict], two: list[dict], rel: float) -> None:
    assert [r.get("step") for r in one] == [r.get("step") for r in two]
    for a, b in zip(one, two, strict=True):
        assert a.keys() <= b.keys()  # (the EP run adds its all-to-all's records)
        for key in ("loss", "grad_norm", "eval_loss", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= rel * abs(a[key]), (key, a[key], b[key])
        if "tokens" in a:
            assert a["tokens"] == b["tokens"]  # each token counted once


def _steps_after(records: list[dict], step: int) -> list[dict]:
    return [r for r in records if "step" in r and r["step"] > step]


def test_sp_training_matches_one_process_and_resumes_at_any_sp(tmp_path) -> None:
    config = str(prepare_stdlib_config(tmp_path, CONFIG, n_files=10, max_chars=100_000))
    single, sp = tmp_path / "single", tmp_path / "sp2"
    sp_args = ("parallel.sp_size=2", "parallel.ep_size=2")
    done = _run(
        {
            "single": [PY, "-m", "moetrain", "train", config, f"run_dir={single}"],
            "sp2": _torchrun("train", config, f"run_dir={sp}", *sp_args),
        },
        tmp_path,
    )
    for name, (code, out) in done.items():
        assert code == 0, (name, out[-4000:])
    assert "world 2 (ep 2, sp 2, zero 2" in done["sp2"][1]
    one, two = _records(single), _records(sp)
    _close(one, two, REL)
    half = sp / "checkpoints" / f"step_{STEPS // 2:08d}"
    assert json.loads((half / "trainer_state.json").read_text())["layout"]["sp_size"] == 2

    resume = f"checkpoint.resume={half}"
    done = _run(
        {
            "again_sp2": _torchrun("train", config, f"run_dir={tmp_path / 'r2'}", resume, *sp_args),
            "as_sp1": _torchrun(
                "train",
                config,
                f"run_dir={tmp_path / 'r1'}",
                resume,
                "parallel.ep_size=2",
                "train.micro_batch_size=1",  # the same global batch on 2 data-parallel ranks
            ),
        },
        tmp_path,
    )
    for name, (code, out) in done.items():
        assert code == 0, (name, out[-4000:])
    assert "continuing at sp_size=1" in done["as_sp1"][1]
    again = _records(tmp_path / "r2")
    after = _steps_after(two, STEPS // 2)
    for a, b in zip(_steps_after(again, STEPS // 2), after, strict=True):
        for key in ("loss", "grad_norm", "eval_loss", "val_loss"):
            assert a.get(key) == b.get(key), (key, a.get(key), b.get(key))  # bit for bit
    _close(_steps_after(one, STEPS // 2), _steps_after(_records(tmp_path / "r1"), STEPS // 2), REL)
