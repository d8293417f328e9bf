"""``run_dir/metrics.jsonl``: one JSON object per logged step, eval and summary (rank 0 only).

A step record holds ``step``, ``loss``, ``ce_loss``, ``moe_loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``tflops_per_s`` ... plus the MoE health and MFU metrics
(:mod:`moetrain.monitor.records`); eval records carry ``val_loss``; the last line is
``{"summary": ...}``. Non-finite floats are written as strings.

A resumed run appends to the file (a step logged again after a restart: the last record wins).
A run that starts at step 0 first sets an earlier run's file aside (:func:`set_aside`), so two
runs never share one file.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):  # tensors and numpy values
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def set_aside(run_dir: str | Path) -> Path | None:
    """Rename a non-empty ``run_dir/metrics.jsonl`` to ``metrics.<n>.jsonl`` (the first free
    ``n`` from 1) and return the new path; None when there is nothing to set aside."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file() or path.stat().st_size == 0:
        return None
    n = 1
    while (target := path.with_name(f"metrics.{n}.jsonl")).exists():
        n += 1
    path.rename(target)
    return target


class MetricsWriter:
    """Appends JSON lines to ``run_dir/metrics.jsonl`` (only where ``enabled``, i.e. rank 0)."""

    def __init__(self, run_dir: str | Path, enabled: bool) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self._fh = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        rec = {k: _jsonable(v) for k, v in record.items()}
        rec.setdefault("time", time.time())
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
