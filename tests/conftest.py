"""Shared test helpers (pytest puts this folder on sys.path for every test module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare_stdlib_config(work: Path, template: str, n_files: int, max_chars: int) -> Path:
    """A config from ``template`` (CORPUS and DATA placeholders) over a corpus made of Python's
    own standard-library sources, prepared through `moetrain prepare`; returns the config."""
    corpus = work / "corpus.txt"
    files = sorted(Path(os.__file__).parent.glob("*.py"))[:n_files]
    corpus.write_text("".join(f.read_text(errors="replace") for f in files)[:max_chars])
    cfg = work / "tiny.yaml"
    cfg.write_text(template.replace("CORPUS", str(corpus)).replace("DATA", str(work / "data")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    subprocess.run(
        [sys.executable, "-m", "moetrain", "prepare", str(cfg)],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )
    return cfg
