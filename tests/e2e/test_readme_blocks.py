"""The README's workflows run as written.

Every ```bash block of README.md is either the quickstart (after ``<!-- quickstart -->``) or a
workflow (after ``<!-- test: workflow -->``). The workflows run in order, each as one
``bash -e -o pipefail`` script, in a temporary copy of the repository's configs where the
quickstart's artifacts already exist: its corpus, tokenizer and shards (``data/``), a trained
``runs/tiny-cpu`` and its Hugging Face export ``runs/tiny-cpu/hf``. Those are made with the
quickstart's own commands, shortened to a few steps; the quickstart's setup (``.venv``) is the
environment the tests run in. A block that exits non-zero fails the test with its output.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.launch import PY, ROOT, env_for

README = ROOT / "README.md"
QUICKSTART = "<!-- quickstart -->"
WORKFLOW = "<!-- test: workflow -->"
BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)
QUICKSTART_STEPS = "train.max_steps=20"  # the quickstart's artifacts, from a short run


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """``(marker, body)`` of every ```bash block in ``text``; the marker is the HTML comment on
    the line just above the fence, or "" when there is none."""
    out = []
    for m in BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((before if before.startswith("<!--") else "", m.group(1)))
    return out


def workflow_blocks() -> list[str]:
    return [body for marker, body in readme_blocks(README.read_text()) if marker == WORKFLOW]


def test_every_bash_block_is_the_quickstart_or_a_tested_workflow() -> None:
    blocks = readme_blocks(README.read_text())
    markers = [marker for marker, _ in blocks]
    assert markers.count(QUICKSTART) == 1, "the README has one quickstart block"
    unmarked = [body for marker, body in blocks if marker not in (QUICKSTART, WORKFLOW)]
    assert not unmarked, f"bash blocks that no test runs: {unmarked}"
    assert len(workflow_blocks()) >= 4


def test_readme_blocks_are_found_with_their_markers() -> None:
    text = f"{QUICKSTART}\n```bash\nbash a.sh\n```\n\nprose\n\n{WORKFLOW}\n```bash\nx\ny\n```\n"
    text += "```bash\nz\n```\n"
    assert readme_blocks(text) == [(QUICKSTART, "bash a.sh\n"), (WORKFLOW, "x\ny\n"), ("", "z\n")]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], what: str) -> None:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (
        f"{what} failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    )


@pytest.fixture(scope="module")
def after_quickstart(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A working directory holding the quickstart's artifacts, and the environment to run the
    README's commands in (the test environment's bin first on PATH, as after activating it)."""
    work = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "configs", work / "configs")
    bin_dir = str(Path(PY).parent)
    env = env_for(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    config = "configs/tiny-cpu.yaml"
    _run([PY, "-m", "moetrain", "prepare", config, QUICKSTART_STEPS], work, env, "prepare")
    torchrun = [str(Path(bin_dir) / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    train = [*torchrun, "-m", "moetrain", "train", config, QUICKSTART_STEPS]
    _run(train, work, env, "train")
    convert = [PY, "-m", "moetrain", "convert", "runs/tiny-cpu", "runs/tiny-cpu/hf", "--overwrite"]
    _run(convert, work, env, "convert")
    return work, env


@pytest.mark.slow
def test_every_workflow_block_runs_as_written(
    after_quickstart: tuple[Path, dict[str, str]],
) -> None:
    work, env = after_quickstart
    for i, body in enumerate(workflow_blocks(), 1):
        first = body.strip().splitlines()[0]
        _run(
            ["bash", "-e", "-o", "pipefail", "-c", body], work, env, f"workflow block {i} ({first})"
        )
