"""Throughput (tokens/s, TFLOP/s, step time) over logging intervals, and peak memory."""

from __future__ import annotations

import time

import torch

from moetrain.config import Config
from moetrain.model_numbers import model_numbers


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
