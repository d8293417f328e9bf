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
from tests.distributed.checkpoint_jobs import fixed_batch, reshard_source_job, reshard_target_job
from tests.distributed.zero3_jobs import export_source_job, reshard_job
from tests.helpers.distributed import run_distributed, run_distributed_concurrently

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


STEPS, STOP = 5, 2  # 3 steps after the resume
REL = 1e-5  # the layout-parity tolerance (test_zero3.py)
# (layout A's stage, then layout B: ep, stage, reset_optimizer) on 2 ranks
TARGETS = [
    ("zero2", 2, 3, False),  # 2 -> 3
    ("zero2", 1, 3, False),  # 2 -> 3 at another EP size
    ("zero3", 2, 2, False),  # 3 -> 2
    ("zero3", 1, 2, False),  # 3 -> 2 at another EP size
    ("zero3", 1, 3, False),  # 3 -> 3 at another EP size
    ("zero2", 2, 3, True),  # the control: 2 -> 3 with the moments reset
]


def _rel_max(a: list[float], b: list[float]) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((ta - tb).abs() / tb.abs()).max())


def test_reshard_to_and_from_zero3_continues_exactly(tmp_path) -> None:
    """A run stopped after ``STOP`` steps on layout A (ZeRO-2 or ZeRO-3 at ep=2), resumed on
    layout B (the other stage, another EP size) with its weights and Adam moments re-partitioned,
    logs the uninterrupted layout-A run's losses (to ``REL``), learning rates and selection
    biases for 3 more steps; the control that resets the moments misses by far more."""
    out = run_distributed(reshard_job, 2, str(tmp_path), STEPS, STOP, TARGETS, timeout=900)
    for rank_out in out:
        assert rank_out["targets"] == out[0]["targets"]  # every rank of layout B agrees
    for (source, ep, stage, reset), got in zip(TARGETS, out[0]["targets"], strict=True):
        case = f"{source} -> ep{ep} zero{stage}" + (" reset" if reset else "")
        want, records = out[0]["source"][source][STOP:], got["records"]
        assert got["step"] == STOP and len(records) == len(want), case
        err = _rel_max([r["loss"] for r in records], [r["loss"] for r in want])
        if reset:
            assert err > 100 * REL, f"{case}: the moments did not matter ({err:.1e})"
            continue
        assert err < REL, f"{case}: losses {err:.2e} apart"
        assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in want], rel=1e-12)
        bias = torch.tensor([r["bias"] for r in records])
        assert torch.allclose(bias, torch.tensor([r["bias"] for r in want]), atol=1e-7), case


@pytest.mark.long
def test_reshard_to_and_from_zero3_at_another_world_size(tmp_path) -> None:
    """4 ranks at ZeRO-3 -> 2 ranks at ZeRO-3 and at ZeRO-2; 2 ranks at ZeRO-2 -> 4 ranks at
    ZeRO-3 (ep=2 throughout): each continues its uninterrupted layout-A run to ``REL``."""
    a4, a2 = run_distributed_concurrently(
        [
            (reshard_source_job, 4, 2, 3, str(tmp_path / "a4"), STEPS, STOP),
            (reshard_source_job, 2, 2, 2, str(tmp_path / "a2"), STEPS, STOP),
        ],
        timeout=900,
    )
    on2 = [(2, 3, a4[0]["checkpoint"], False), (2, 2, a4[0]["checkpoint"], False)]
    on4 = [(2, 3, a2[0]["checkpoint"], False)]
    b2, b4 = run_distributed_concurrently(
        [
            (reshard_target_job, 2, on2, str(tmp_path / "b2"), STEPS),
            (reshard_target_job, 4, on4, str(tmp_path / "b4"), STEPS),
        ],
        timeout=900,
    )
    cases = [("4 -> 2 zero3", a4, b2[0][0]), ("4 -> 2 zero2", a4, b2[0][1])]
    for case, source, got in [*cases, ("2 -> 4 zero3", a2, b4[0][0])]:
        want = source[0]["records"][STOP:]
        err = _rel_max([r["loss"] for r in got["records"]], [r["loss"] for r in want])
        assert got["step"] == STOP and err < REL, f"{case}: losses {err:.2e} apart"
