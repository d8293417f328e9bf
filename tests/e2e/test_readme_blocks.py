"""The README's workflows run as written.

Every fenced block of README.md names its language, and every shell block (``bash``, ``sh``,
any shell fence) is the quickstart (after ``<!-- quickstart -->``), a workflow (after
``<!-- test: workflow -->``) or a block that starts a server (after ``<!-- test: serving -->``).
The workflows run in order, each as one ``bash -e -o pipefail`` script, in a temporary copy of
the repository's configs where the quickstart's artifacts already exist: its corpus, tokenizer
and shards (``data/``), a trained ``runs/tiny-cpu`` and its Hugging Face export
``runs/tiny-cpu/hf``. Those are made with the quickstart's own commands, shortened to a few
steps; the quickstart's setup (``.venv``) is the environment the tests run in. A block that
exits non-zero fails the test with its output. The default suite runs the blocks that train
nothing (each training block is minutes on 2 cores); ``-m long`` runs every block. The serving blocks start their server in the
background, use it and stop it; they run the same way, on a free port, with the opt-in serving
tests (``-m serving``, which need ``.venv-serving``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers.launch import PY, ROOT, env_for
from tests.helpers.ports import free_port

README = ROOT / "README.md"
QUICKSTART = "<!-- quickstart -->"
WORKFLOW = "<!-- test: workflow -->"
SERVING = "<!-- test: serving -->"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.S | re.M)
SHELLS = ("bash", "sh", "shell", "zsh", "console")
QUICKSTART_STEPS = "train.max_steps=2"  # the quickstart's artifacts, from a short run
SERVING_VENV = ROOT / ".venv-serving"
PORT = re.compile(r"\b8000\b")  # the serving blocks' port
TRAINS = re.compile(r"\bmoetrain train\b")  # a block that launches a training run


def fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, marker, body)`` of every fenced block in ``text``; the marker is the HTML
    comment on the line just above the fence, or "" when there is none."""
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((m.group(1), before if before.startswith("<!--") else "", m.group(2)))
    return out


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """``(marker, body)`` of every shell block in ``text`` (any shell fence)."""
    return [(marker, body) for lang, marker, body in fenced_blocks(text) if lang in SHELLS]


def workflow_blocks() -> list[str]:
    return [body for marker, body in readme_blocks(README.read_text()) if marker == WORKFLOW]


def serving_blocks() -> list[str]:
    return [body for marker, body in readme_blocks(README.read_text()) if marker == SERVING]


def test_every_bash_block_is_the_quickstart_or_a_tested_workflow() -> None:
    """Every shell block, whatever its fence, is run by a test: the quickstart, a workflow, or
    a serving block; a block without a language would escape this, so none has one."""
    text = README.read_text()
    unnamed = [body for lang, _, body in fenced_blocks(text) if not lang]
    assert not unnamed, f"fenced blocks that name no language: {unnamed}"
    blocks = readme_blocks(text)
    markers = [marker for marker, _ in blocks]
    assert markers.count(QUICKSTART) == 1, "the README has one quickstart block"
    unmarked = [body for marker, body in blocks if marker not in (QUICKSTART, WORKFLOW, SERVING)]
    assert not unmarked, f"shell blocks that no test runs: {unmarked}"
    assert len(workflow_blocks()) >= 4


def test_serving_blocks_start_use_and_stop_a_server() -> None:
    """The serving marker is for a block that needs a server, not a way around the workflow
    test: each starts one in the background on the port the test replaces, waits for it and
    stops it."""
    blocks = serving_blocks()
    assert blocks, "the README shows how to serve an export"
    for body in blocks:
        lines = [line.strip() for line in body.splitlines()]
        assert any(line.endswith("&") for line in lines), f"starts no server: {body}"
        assert PORT.search(body), f"uses no port 8000: {body}"
        assert lines[-1].startswith("kill"), f"does not stop its server: {body}"


def test_fenced_blocks_are_found_with_their_languages() -> None:
    text = f"{SERVING}\n```sh\nserve &\n```\n\n```\nsynopsis\n```\n```yaml\na: 1\n```\n"
    assert fenced_blocks(text) == [
        ("sh", SERVING, "serve &\n"),
        ("", "", "synopsis\n"),
        ("yaml", "", "a: 1\n"),
    ]
    assert readme_blocks(text) == [(SERVING, "serve &\n")]


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


def _run_workflows(work: Path, env: dict[str, str], train: bool) -> int:
    """Run the workflow blocks in order (those that train too, with ``train``); -> how many."""
    ran = 0
    for i, body in enumerate(workflow_blocks(), 1):
        if not train and TRAINS.search(body):
            continue
        first = body.strip().splitlines()[0]
        _run(
            ["bash", "-e", "-o", "pipefail", "-c", body], work, env, f"workflow block {i} ({first})"
        )
        ran += 1
    return ran


@pytest.mark.slow
def test_workflow_blocks_that_train_nothing_run_as_written(
    after_quickstart: tuple[Path, dict[str, str]],
) -> None:
    """The default suite's case: the quickstart (its fixture) and the blocks that only use its
    artifacts (convert, generate, transformers); every block runs with -m long."""
    assert _run_workflows(*after_quickstart, train=False) >= 1


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(1800)  # the quickstart (its fixture) and every workflow block, in turn
def test_every_workflow_block_runs_as_written(
    after_quickstart: tuple[Path, dict[str, str]],
) -> None:
    assert _run_workflows(*after_quickstart, train=True) == len(workflow_blocks())


@pytest.mark.serving
def test_every_serving_block_runs_as_written(
    after_quickstart: tuple[Path, dict[str, str]],
) -> None:
    """With vLLM's venv (``launch/serving-venv.sh``): each serving block serves the quickstart's
    export, on a free port; its own commands check that the server answers."""
    if not (SERVING_VENV / "bin" / "python").is_file():
        pytest.skip(f"{SERVING_VENV.name} is missing: create it with `bash launch/serving-venv.sh`")
    work, env = after_quickstart
    for name in ("launch", SERVING_VENV.name):
        if not (work / name).exists():
            (work / name).symlink_to(ROOT / name)
    for i, body in enumerate(serving_blocks(), 1):
        script = PORT.sub(str(free_port()), body)
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the server's engine processes go with it
        )
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, f"serving block {i} failed:\n{out[-4000:]}"
        assert '"choices"' in out, f"serving block {i} got no completion:\n{out[-4000:]}"
