"""Shared test helpers (pytest puts this folder on sys.path for every test module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every process the tests start JIT-loads DeepSpeed's shm comm op (deepspeed.comm's TorchBackend)
# through torch.utils.cpp_extension, which runs the first `ninja` on PATH in a shared build
# folder. The virtualenv's ninja (1.13, a DeepSpeed dependency) and a system ninja (1.11) hash
# the build commands differently, so whenever the other one built last, the op is compiled
# again: about a minute of two compilers on 2 cores while every rank waits on the build lock.
# Some tests put the virtualenv's bin first on PATH (they need its torchrun and deepspeed), others
# inherited pytest's PATH, so a suite run alternated between the two and rebuilt several times.
# One PATH for every child (the virtualenv's bin first) and a build folder of the tests' own, so
# that other work on the machine with another ninja does not invalidate it either.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "torch_extensions"
        / f"moetrain-tests-py{sys.version_info.major}{sys.version_info.minor}"
    ),
)


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
