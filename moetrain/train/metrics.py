"""Training metrics: throughput numbers, the JSONL metrics file and console progress lines.

``run_dir/metrics.jsonl`` gets one JSON object per logged step (rank 0 only), e.g.
``{"step", "loss", "ce_loss", "moe_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_s",
...}`` plus the MoE health and MFU metrics of ``moetrain.monitor``; eval records carry
``"val_loss"``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from moetrain.config import Config
from moetrain.numbers import model_numbers


class Throughput:
    """Tokens/s and TFLOP/s over the last interval (whole job and per rank)."""

    def __init__(self, cfg: Config, world_size: int, tokens_per_step: int) -> None:
        self.flops_per_token = model_numbers(cfg).flops_per_token
        self.world_size = world_size
        self.tokens_per_step = tokens_per_step
        self._t0 = time.perf_counter()
        self._steps = 0

    def mark(self) -> None:
        """Start a new interval (call after warm-up steps to leave them out)."""
        self._t0 = time.perf_counter()
        self._steps = 0

    def step(self) -> None:
        self._steps += 1

    def measure(self) -> dict[str, float]:
        """Numbers for the interval since :meth:`mark`; starts the next interval."""
        dt = max(time.perf_counter() - self._t0, 1e-9)
        tokens_per_s = self._steps * self.tokens_per_step / dt
        tflops = tokens_per_s * self.flops_per_token / 1e12
        out = {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": tokens_per_s / self.world_size,
            "tflops_per_s": tflops,
            "tflops_per_s_per_rank": tflops / self.world_size,
            "step_time_s": dt / max(self._steps, 1),
        }
        self.mark()
        return out


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak accelerator memory (GiB) on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    try:
        import resource

        return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    except (ImportError, OSError):
        return {}


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


class MetricsWriter:
    """Appends JSON lines to ``run_dir/metrics.jsonl`` (only where ``enabled``, i.e. rank 0)."""

    def __init__(self, run_dir: str | Path, enabled: bool) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
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


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_line(step: int, total: int, rec: dict[str, Any], eta_s: float) -> str:
    """One console line: step, loss, lr, tokens/s, ETA."""
    return (
        f"step {step}/{total} | loss {rec['loss']:.4f} (ce {rec['ce_loss']:.4f}) | "
        f"lr {rec['lr']:.3g} | grad {rec['grad_norm']:.3g} | "
        f"{rec.get('tokens_per_s', 0.0):,.0f} tok/s | ETA {format_eta(eta_s)}"
    )
