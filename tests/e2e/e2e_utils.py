"""Helpers for the end-to-end tests: a generated corpus, clean launcher environments, metrics."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/tiny-cpu.yaml")
PY = sys.executable

# A model small enough for several launches per test module on 2 cores.
TINY = [
    "model.vocab_size=512",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.dense_hidden=128",
    "moe.expert_hidden=64",
    "data.seq_len=64",
    "data.num_proc=1",
    "parallel.timeout_minutes=2",
    "optim.warmup_steps=2",
    "train.log_every=1",
    "train.eval_every=0",
    "logging.wandb.mode=disabled",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(**extra: str) -> dict[str, str]:
    """The current environment without launcher/SLURM variables, one thread per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NPROC", "NNODES"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHON=PY, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def write_corpus(path: Path, docs: int = 600) -> None:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(400)]
    text = "\n\n".join(
        " ".join(rng.choices(words, k=rng.randint(20, 120))) + "." for _ in range(docs)
    )
    path.write_text(text + "\n")


def prepare_tiny_data(directory: Path, overrides: list[str] | None = None) -> list[str]:
    """Corpus -> tokenizer -> shards through `moetrain prepare`; returns the config overrides."""
    write_corpus(directory / "corpus.txt")
    ov = [
        *TINY,
        *(overrides or []),
        f"data.source={directory / 'corpus.txt'}",
        f"data.output_dir={directory / 'data'}",
    ]
    r = subprocess.run(
        [PY, "-m", "moetrain", "prepare", CONFIG, *ov],
        env=env_for(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return ov


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
