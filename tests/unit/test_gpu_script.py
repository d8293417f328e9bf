"""The prepared GPU script runs its CPU dry run end to end and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_h200.py"


def test_gpu_script_dry_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--engine", "torch", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_h200.json").read_text())
    assert res["dry_run"] is True
    assert res["correctness"]["fp32"]["logits_rel_err"] <= 1e-4
    assert res["grouped_gemm"]["rel_err_grouped_vs_loop"] < 1e-5
    train = res["train"]
    assert train["engine"].startswith("torch AdamW")
    assert train["tokens_per_s"] > 0 and len(train["losses"]) >= 2
    assert train["plan_predicted_bytes"] > 0
    assert res["nccl"]["value_ok"] and res["nccl"]["world_size"] == 1
    assert "correctness fp32" in proc.stdout and "all_reduce" in proc.stdout
