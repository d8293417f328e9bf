"""TFLOP/s and MFU against a hand calculation; peak table lookups; the CPU probe."""

import pytest

from moetrain.config import Config
from moetrain.model_numbers import model_numbers
from moetrain.monitor.mfu import (
    CPU_MFU_METRIC,
    GPU_MFU_METRIC,
    Peak,
    cpu_gemm_tflops,
    lookup_peak_tflops,
    math_type,
    mfu,
    perf_metrics,
    resolve_peak,
    tflops_per_device,
)
from tests.helpers.configs import tiny_config


def _config() -> Config:
    return tiny_config(
        model__vocab_size=1000,
        model__d_model=64,
        model__dense_hidden=1024,
        model__max_seq_len=2048,
        moe__expert_hidden=128,
    )


def test_flops_per_token_by_hand():
    # head_dim 16. attention weights: 64*(4*16)*2 + 64*(2*16)*2 = 8192 + 4096 = 12288
    # MoE active: router 64*4 = 256 + top_k 2 * 3*64*128 = 49152 -> 49408
    # per layer 61696; 2 layers 123392; + LM head 1000*64 = 64000 -> 187392 matmul params
    # 6 * 187392 = 1124352; attention 12 * 2 layers * 4 heads * 16 * seq 32 = 49152
    assert model_numbers(_config()).flops_per_token == 1_173_504


def test_tflops_and_mfu_by_hand():
    fpt = model_numbers(_config()).flops_per_token
    # 1e8 tokens/s/device * 1173504 FLOPs = 1.173504e14 FLOP/s = 117.3504 TFLOP/s
    assert tflops_per_device(1e8, fpt) == pytest.approx(117.3504)
    # on an H100 SXM in bf16 (989.4 TFLOP/s dense): 117.3504 / 989.4 = 0.118607...
    peak = lookup_peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989.4
    assert mfu(1e8, fpt, peak) == pytest.approx(0.1186076, rel=1e-6)
    m = perf_metrics(1e8, fpt, Peak(peak, "table", GPU_MFU_METRIC))
    assert m == pytest.approx({"perf/tflops_per_device": 117.3504, "perf/mfu": 0.1186076}, rel=1e-6)
    assert perf_metrics(1e8, fpt, None) == pytest.approx({"perf/tflops_per_device": 117.3504})


@pytest.mark.parametrize(
    "name, math, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA A100-SXM4-40GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA A10G", "bf16", 70.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L4", "fp32", 30.3),
        ("NVIDIA GeForce RTX 4090", "fp16", 165.2),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_peak_table_lookup(name, math, expected):
    assert lookup_peak_tflops(name, math) == expected


def test_math_type():
    assert math_type("bf16") == "bf16"
    assert math_type("fp32") == "fp32"
    assert math_type("fp32", allow_tf32=True) == "tf32"
    with pytest.raises(ValueError, match="precision"):
        math_type("int8")


def test_cpu_peak_is_measured_and_named_as_such():
    override = resolve_peak("fp32", override_tflops=2.5, device="cpu")
    assert override == Peak(2.5, "logging.peak_tflops (override)", CPU_MFU_METRIC)
    peak = resolve_peak("fp32", device="cpu")
    assert peak is not None and peak.metric == "perf/mfu_vs_cpu_gemm"
    assert "measured" in peak.source and 1e-5 < peak.tflops < 100
    assert resolve_peak("fp32", device="cpu").tflops == peak.tflops  # cached per process
    assert cpu_gemm_tflops.cache_info().hits >= 1
