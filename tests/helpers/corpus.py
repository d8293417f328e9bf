"""Corpora prepared through the real CLI (``python -m moetrain prepare``), for the tests that
train through it: a generated corpus of random words or one of Python's own standard-library
sources, written to a path and tokenized into shards next to it.

The fixture ``tiny_data`` (registered for every test by tests/conftest.py) prepares the
generated corpus once per session; tests read it and never change it. A test that changes its
data, or needs other data settings, prepares its own with :func:`prepare_tiny_data` or
:func:`prepare_stdlib_config`.
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.configs import Override, cli_args, tiny_config
from tests.helpers.launch import CONFIG, PY, ROOT, env_for


def write_words_corpus(path: Path, docs: int = 600, words: int = 400) -> Path:
    """``docs`` documents drawn from ``words`` random lowercase words (fixed seed), blank-line
    separated."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(words)]
    text = "\n\n".join(
        " ".join(rng.choices(vocab, k=rng.randint(20, 120))) + "." for _ in range(docs)
    )
    path.write_text(text + "\n")
    return path


def write_stdlib_corpus(path: Path, n_files: int, max_chars: int) -> Path:
    """The first ``max_chars`` characters of Python's first ``n_files`` standard-library
    modules (sorted by name), as one text file."""
    files = sorted(Path(os.__file__).parent.glob("*.py"))[:n_files]
    path.write_text("".join(f.read_text(errors="replace") for f in files)[:max_chars])
    return path


def run_prepare(config: str | Path, overrides: Sequence[str] = ()) -> None:
    """``python -m moetrain prepare CONFIG [overrides]`` in a clean environment; its output
    is the failure message."""
    r = subprocess.run(
        [PY, "-m", "moetrain", "prepare", str(config), *overrides],
        env=env_for(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def prepare_tiny_data(directory: Path, *overrides: Override, **settings: Any) -> list[str]:
    """The generated corpus (``directory/corpus.txt``) prepared into ``directory/data`` for
    configs/tiny-cpu.yaml with :func:`~tests.helpers.configs.cli_args` ``(*overrides,
    **settings)``; returns those command-line overrides, data paths included."""
    corpus = write_words_corpus(directory / "corpus.txt")
    ov = cli_args(*overrides, **settings)
    ov += [f"data.source={corpus}", f"data.output_dir={directory / 'data'}"]
    run_prepare(CONFIG, ov)
    return ov


def prepare_stdlib_config(
    directory: Path, *overrides: Override, n_files: int, max_chars: int, **settings: Any
) -> Path:
    """A standard-library corpus (``directory/corpus.txt``, see :func:`write_stdlib_corpus`)
    and a config file ``directory/tiny.yaml`` of :func:`~tests.helpers.configs.tiny_config`
    ``(*overrides, **settings)`` reading it, prepared into ``directory/data``; returns the
    config file."""
    corpus = write_stdlib_corpus(directory / "corpus.txt", n_files, max_chars)
    paths = {"data.source": str(corpus), "data.output_dir": str(directory / "data")}
    cfg = directory / "tiny.yaml"
    cfg.write_text(tiny_config(*overrides, paths, **settings).to_yaml())
    run_prepare(cfg)
    return cfg


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The command-line overrides (on configs/tiny-cpu.yaml) of the CLI tests' model over the
    generated corpus, prepared once per session (:func:`prepare_tiny_data`). Read only."""
    return prepare_tiny_data(tmp_path_factory.mktemp("tiny-data"))
