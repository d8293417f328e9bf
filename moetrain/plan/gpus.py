"""The GPUs ``moetrain plan`` knows: their peak FLOPs (from
:data:`moetrain.monitor.mfu.PEAK_TFLOPS`) and memory."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config import ConfigError
from moetrain.monitor.mfu import lookup_peak_tflops, math_type

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class GPUSpec:
    """A GPU: its row in :data:`moetrain.monitor.mfu.PEAK_TFLOPS` and memory as the driver
    reports it (MiB)."""

    name: str
    table_key: str
    memory_mib: int

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for ``train.precision`` (bf16/fp16 tensor cores; fp32 without tf32)."""
        value = lookup_peak_tflops(self.table_key, math_type(precision))
        if value is None:  # e.g. bf16 on a V100: its fp16 tensor peak
            value = lookup_peak_tflops(self.table_key, "fp16")
        assert value is not None, self.table_key
        return value


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("NVIDIA H100 SXM 80GB", "H100 SXM", 81559),
    "h100-pcie": GPUSpec("NVIDIA H100 PCIe 80GB", "H100 PCIe", 81559),
    "h200": GPUSpec("NVIDIA H200 141GB", "H200", 143771),
    "a100": GPUSpec("NVIDIA A100 80GB", "A100", 81920),
    "a100-40gb": GPUSpec("NVIDIA A100 40GB", "A100", 40960),
    "a10g": GPUSpec("NVIDIA A10G 24GB", "A10G", 23028),
    "l4": GPUSpec("NVIDIA L4 24GB", "L4", 23034),
    "l40s": GPUSpec("NVIDIA L40S 48GB", "L40S", 46068),
    "v100": GPUSpec("NVIDIA V100 SXM2 32GB", "V100 SXM2", 32768),
    "mi300x": GPUSpec("AMD Instinct MI300X 192GB", "MI300X", 196592),
    "rtx4090": GPUSpec("NVIDIA GeForce RTX 4090 24GB", "RTX 4090", 24564),
}

FRAMEWORK_BYTES = 1 * GiB  # CUDA context + cuBLAS workspace + NCCL + allocator slack


def gpu_spec(name: str) -> GPUSpec:
    """Look up a GPU by its short name (case-insensitive)."""
    key = name.lower().replace("_", "-")
    if key not in GPUS:
        raise ConfigError(f"--gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
