"""The prepared GPU script runs its CPU dry run end to end through moetrain's trainer and writes
its JSON; a missing required piece stops it before anything is measured."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_h200.py"


def test_gpu_script_dry_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_h200.json").read_text())
    assert res["dry_run"] is True and res["torch"] and res["preflight"]["grouped_mm_available"]
    assert res["preflight"]["grouped_mm_refusal"] is None
    assert res["correctness"]["fp32"]["logits_rel_err"] <= 1e-4
    gg = res["grouped_gemm"]
    assert gg["rel_err_grouped_vs_loop"] < 1e-5 and gg["path"] == "grouped_mm"
    assert gg["zero_token_experts_max_abs_grad"] == 0.0
    assert res["attention"]["kernel"].endswith("(mask)")
    assert res["host_syncs"]["dropless"]["ops"] == {}
    assert res["host_syncs"]["capacity_1.25"]["ops"] == {"_local_scalar_dense": 1}
    assert res["train_mla_mtp"]["ok"], res["train_mla_mtp"]
    train = res["train"]
    assert train["step"] == "moetrain.train.trainer.Trainer.train_step"
    assert train["tokens_per_s"] > 0 and len(train["losses"]) >= 2
    assert train["experts_path"] == ["grouped_mm"] and train["synchronize_calls"] == {}
    assert train["attention_kernel"].endswith("(causal)")
    assert 0.85 <= train["timer_vs_wall"] <= 1.05
    assert train["plan_predicted_bytes"] > 0
    assert train["optimizer"] == "DeepSpeedZeroOptimizer" and train["grad_accum_dtype"] == "fp32"
    zero3 = res["train_zero3"]  # every weight a partition, one rank: the ZeRO-1 run's losses
    assert zero3["zero_stage"] == 3 and zero3["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert zero3["losses_rel_diff_vs_zero1"] <= 1e-5, zero3
    prec = res["precision"]  # bf16 runs on CPU too; fp16 needs the GPU
    assert prec["ok"], prec
    assert prec["bf16_zero1"]["optimizer"] == "BF16_Optimizer"
    assert prec["bf16_zero2"]["skip"] == {"skipped": True, "state_unchanged": True}
    assert "fp16" in prec and "no fp16" in prec["fp16"]["skipped"]
    assert res["nccl"]["value_ok"] and res["nccl"]["world_size"] == 1
    assert "correctness fp32" in proc.stdout and "all_reduce" in proc.stdout


def test_a_missing_piece_stops_the_run_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    spec = importlib.util.spec_from_file_location("gpu_h200", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delattr(F, "grouped_mm")
    assert module.main(["--dry-run", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "MISSING" in err and "torch.nn.functional.grouped_mm" in err
    res = json.loads((tmp_path / "gpu_h200.json").read_text())
    assert res["missing"] and "correctness" not in res


def test_out_is_explicit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """No output directory is taken from the environment: without ``--out`` the script stops
    before measuring anything, whatever ``OUT`` holds."""
    spec = importlib.util.spec_from_file_location("gpu_h200", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        module.main(["--dry-run"])
    assert stop.value.code == 2 and "--out" in capsys.readouterr().err
    assert not (tmp_path / "gpu_h200.json").exists()
