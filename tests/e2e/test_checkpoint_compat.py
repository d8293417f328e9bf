"""Checkpoints written before the current code still load: a format-1 checkpoint kept as a
fixture (see tests/fixtures/checkpoint_v1/README.md) gives the same logits through the reader
and, resumed by `moetrain train`, the same losses bit for bit as the code that wrote it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.corpus import run_prepare, write_words_corpus
from tests.helpers.launch import CONFIG, PY, ROOT, env_for, losses

FIXTURE = ROOT / "tests/fixtures/checkpoint_v1"
CKPT = FIXTURE / "step_00000003"

pytestmark = pytest.mark.slow


def test_format1_checkpoint_reads_with_the_same_logits() -> None:
    from moetrain.checkpoint.read import load_model
    from moetrain.model.cpu_matmul import use_cpu_matmul

    expected = torch.load(FIXTURE / "expected_logits.pt", weights_only=True)
    model, _ = load_model(CKPT)
    use_cpu_matmul("torch")  # the kernels the fixture's logits were computed with
    try:
        with torch.no_grad():
            logits = model(expected["input_ids"]).logits
    finally:
        use_cpu_matmul("onednn")
    assert torch.equal(logits, expected["logits"])


def test_format1_checkpoint_resumes_with_the_same_losses(tmp_path: Path) -> None:
    spec = json.loads((FIXTURE / "expected.json").read_text())
    write_words_corpus(tmp_path / "corpus.txt", spec["corpus"]["docs"], spec["corpus"]["words"])
    run_dir = tmp_path / "run"
    shutil.copytree(CKPT, run_dir / "checkpoints" / CKPT.name)
    ov = [
        *spec["overrides"],
        f"data.source={tmp_path / 'corpus.txt'}",
        f"data.output_dir={tmp_path / 'data'}",
        f"data.tokenizer_model={CKPT / 'tokenizer.model'}",
        f"run_dir={run_dir}",
    ]
    run_prepare(CONFIG, ov)
    r = subprocess.run(
        [PY, "-m", "moetrain", "train", CONFIG, *ov, *spec["resume_overrides"]],
        env=env_for(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = {int(k): v for k, v in spec["resume_losses"].items()}
    assert losses(run_dir) == want
