"""Throughput in TFLOP/s per device and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / the device's peak FLOP/s, where achieved model FLOP/s =
tokens/s per device x ``moetrain.model_numbers.model_numbers(cfg).flops_per_token`` (6 x active matmul
params + attention, forward + backward; activation recomputation is not counted).

The peak comes from, in order: ``logging.peak_tflops`` (override), the table below matched on
``torch.cuda.get_device_name()`` (vendor datasheet dense numbers, no 2:4 sparsity), and on CPU a
*measured* number: the fp32 GEMM throughput of this process's threads through the model's CPU
matmul kernel (``train.cpu_matmul``), probed once at startup per rank (so concurrent ranks share
cores as in training). CPU "MFU" is therefore reported under its own name,
``perf/mfu_vs_cpu_gemm``: the fraction of what one big matmul reaches on this machine, not of a
hardware peak. GPU MFU is ``perf/mfu``.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Any

# Dense TFLOP/s per device by math type (vendor datasheets, no 2:4 sparsity). "fp32" is the
# non-tensor-core rate (torch's default for fp32 matmuls); "tf32" applies when
# torch.backends.cuda.matmul.allow_tf32 is on; fp16 equals bf16 wherever bf16 exists, so the fp16
# column is only filled where there is no bf16. "-": the device has no such rate.
_PEAK_TABLE = """
device      bf16    tf32    fp32   fp16
B200        2250.0  1100.0  75.0   -
H200        989.4   494.7   66.9   -
H200 NVL    835.0   417.5   60.0   -
GH200       989.4   494.7   66.9   -
H100 SXM    989.4   494.7   66.9   -
H100 NVL    835.0   417.5   60.0   -
H100 PCIe   756.0   378.0   51.2   -
H800        989.4   494.7   66.9   -
A100        312.0   156.0   19.5   -
A800        312.0   156.0   19.5   -
A10G        70.0    35.0    31.2   -
A10         125.0   62.5    31.2   -
L40S        362.0   183.0   91.6   -
L40         181.0   90.5    90.5   -
L4          121.0   60.0    30.3   -
RTX A6000   154.8   77.4    38.7   -
RTX 4090    165.2   82.6    82.6   -
RTX 3090    71.0    35.6    35.6   -
V100 SXM2   -       -       15.7   125.0
V100 PCIe   -       -       14.0   112.0
T4          -       -       8.1    65.0
MI300X      1307.4  653.7   163.4  -
MI325X      1307.4  653.7   163.4  -
MI250X      383.0   -       95.7   -
MI250       362.1   -       90.5   -
"""  # A100 / A800: 40 GB and 80 GB, SXM and PCIe


def _parse_peaks(table: str) -> dict[str, dict[str, float]]:
    header, *rows = table.strip().splitlines()
    columns = header.split()[1:]
    out = {}
    for row in rows:
        device, *values = re.split(r"\s{2,}", row.strip())  # names may hold one space
        out[device] = {c: float(v) for c, v in zip(columns, values, strict=True) if v != "-"}
    return out


PEAK_TFLOPS: dict[str, dict[str, float]] = _parse_peaks(_PEAK_TABLE)

# (pattern on the device name, table key); first match wins, so specific names come first.
_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"\bB200\b", "B200"),
    (r"\bGH200\b", "GH200"),
    (r"\bH200 NVL\b", "H200 NVL"),
    (r"\bH200\b", "H200"),
    (r"\bH100 NVL\b", "H100 NVL"),
    (r"\bH100\b.*\bPCI", "H100 PCIe"),
    (r"\bH100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"\bH800\b", "H800"),
    (r"\bA100\b", "A100"),
    (r"\bA800\b", "A800"),
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bRTX A6000\b", "RTX A6000"),
    (r"\b4090\b", "RTX 4090"),
    (r"\b3090\b", "RTX 3090"),
    (r"\bV100\b.*\bPCI", "V100 PCIe"),
    (r"\bV100\b", "V100 SXM2"),
    (r"\bT4\b", "T4"),
    (r"\bMI300X\b", "MI300X"),
    (r"\bMI325X\b", "MI325X"),
    (r"\bMI250X\b", "MI250X"),
    (r"\bMI250\b", "MI250"),
]

GPU_MFU_METRIC = "perf/mfu"
CPU_MFU_METRIC = "perf/mfu_vs_cpu_gemm"


def match_device(name: str) -> str | None:
    """Table key for a device name such as ``torch.cuda.get_device_name()``; None if unknown."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return key
    return None


def math_type(precision: str, allow_tf32: bool = False) -> str:
    """The table column for ``train.precision``: bf16 | fp16 | fp32 (tf32 if allowed)."""
    if precision in ("bf16", "fp16"):
        return precision
    if precision == "fp32":
        return "tf32" if allow_tf32 else "fp32"
    raise ValueError(f"unknown precision {precision!r}; expected fp32, bf16 or fp16")


def lookup_peak_tflops(name: str, math: str) -> float | None:
    """Dense peak TFLOP/s of the named device for a math type, or None if not in the table."""
    key = match_device(name)
    if key is None:
        return None
    row = PEAK_TFLOPS[key]
    if math == "fp16" and "fp16" not in row:
        return row.get("bf16")
    return row.get(math)


@dataclass(frozen=True)
class Peak:
    """The denominator of MFU: ``tflops`` per device, where it came from, and the metric name."""

    tflops: float
    source: str
    metric: str


@functools.lru_cache(maxsize=8)
def cpu_gemm_tflops(
    size: int = 1024,
    min_seconds: float = 0.3,
    threads: int | None = None,
    kernel: str | None = None,
) -> float:
    """Measured fp32 GEMM throughput (TFLOP/s) of this process on CPU, ``size`` x ``size``
    matrices, torch's current thread count, through the kernel the model's matmuls use
    (:mod:`moetrain.model.cpu_matmul`); cached per process (argument tuple: ``threads`` and
    ``kernel`` are part of the key only)."""
    import torch

    from moetrain.model.cpu_matmul import mm

    del threads, kernel
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    mm(a, b)  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        mm(a, b)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return 2.0 * size**3 * n / elapsed / 1e12


def resolve_peak(
    precision: str,
    override_tflops: float | None = None,
    device: Any = None,
) -> Peak | None:
    """Peak for MFU: the override, else the GPU table, else a measured CPU GEMM.

    ``device``: a torch device (default: cuda if available, else cpu). Returns None for a GPU
    missing from the table (then only TFLOP/s is reported; set ``logging.peak_tflops``).
    """
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    metric = CPU_MFU_METRIC if dev.type == "cpu" else GPU_MFU_METRIC
    if override_tflops is not None:
        return Peak(float(override_tflops), "logging.peak_tflops (override)", metric)
    if dev.type == "cpu":
        from moetrain.model.cpu_matmul import cpu_matmul_choice

        threads, kernel = torch.get_num_threads(), cpu_matmul_choice()
        tflops = cpu_gemm_tflops(threads=threads, kernel=kernel)
        source = f"measured fp32 1024x1024 GEMM on CPU ({kernel}), {threads} threads"
        return Peak(tflops, source, metric)
    name = torch.cuda.get_device_name(dev)
    math = math_type(precision, bool(torch.backends.cuda.matmul.allow_tf32))
    tflops = lookup_peak_tflops(name, math)
    if tflops is None:
        return None
    return Peak(tflops, f"table: {match_device(name)} {math} dense ({name})", metric)


def tflops_per_device(tokens_per_s_per_device: float, flops_per_token: float) -> float:
    """Achieved model TFLOP/s per device."""
    return tokens_per_s_per_device * flops_per_token / 1e12


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in [0, 1] (fraction of ``peak_tflops``)."""
    return tflops_per_device(tokens_per_s_per_device, flops_per_token) / peak_tflops


def perf_metrics(
    tokens_per_s_per_device: float, flops_per_token: float, peak: Peak | None
) -> dict[str, float]:
    """``perf/tflops_per_device`` and, when a peak is known, ``peak.metric`` (MFU)."""
    out = {"perf/tflops_per_device": tflops_per_device(tokens_per_s_per_device, flops_per_token)}
    if peak is not None and peak.tflops > 0:
        out[peak.metric] = mfu(tokens_per_s_per_device, flops_per_token, peak.tflops)
    return out
