"""A ZeRO-3 checkpoint read back (moetrain/checkpoint/read.py through the partitions,
moetrain/checkpoint/reshard.py's ``SavedOptimizer``): ``moetrain convert`` of a stage-3 run on 2
ranks (dp=2: every dense weight and every expert partitioned over both ranks) gives the Hugging
Face directory of the same run at stage 2, and transformers' logits equal the live stage-3
model's.

Tolerance: the two stages reduce in another order (about 1e-7 relative here); ``TOL`` is 1e-5
relative per tensor. Negative control: the stage-3 run's export one step earlier is told apart
from its last one by far more than ``TOL``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetrain.convert.export import convert_checkpoint
from moetrain.convert.hf_files import HFWeights
from tests.distributed.checkpoint_jobs import fixed_batch
from tests.distributed.zero3_jobs import export_source_job
from tests.helpers.distributed import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

TOL = 1e-5


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = HFWeights(path)
    return {n: weights.load([n])[n] for n in weights.names()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    from moetrain.data.tokenizer import train_tokenizer

    text = ["the cat sat on the mat 123", "tokens and more tokens, 42"] * 30
    return train_tokenizer(text, 320, tmp_path_factory.mktemp("sp")).path


def test_zero3_checkpoint_converts_to_stage2s_export_and_transformers_logits(
    tmp_path, sp_model
) -> None:
    runs = run_distributed(export_source_job, 2, str(tmp_path / "runs"), 1, timeout=600)[0]
    out = {}
    for name, path in (
        ("zero2", runs["zero2"]["checkpoints"][1]),
        ("zero3", runs["zero3"]["checkpoints"][1]),
        ("zero3_step1", runs["zero3"]["checkpoints"][0]),
    ):
        out[name] = convert_checkpoint(path, tmp_path / name, tokenizer=sp_model)
    two, three, early = (_tensors(out[k]) for k in ("zero2", "zero3", "zero3_step1"))
    assert set(two) == set(three) and any(".experts." in n for n in three)
    for name, ref in two.items():
        assert _rel(three[name], ref) <= TOL, f"{name}: {_rel(three[name], ref):.2e}"
    assert max(_rel(early[n], ref) for n, ref in two.items()) > 100 * TOL
    hf = transformers.AutoModelForCausalLM.from_pretrained(out["zero3"], dtype=torch.float32)
    with torch.no_grad():
        logits = hf.eval()(input_ids=fixed_batch()).logits
    torch.testing.assert_close(logits, runs["zero3"]["logits"], atol=1e-4, rtol=1e-4)
