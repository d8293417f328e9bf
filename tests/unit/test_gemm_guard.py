"""The grouped-GEMM guard with the device, capability, shapes and torch version as inputs; and
on CPU: a shape torch's kernel refuses (bf16, F = 12) falls back to the per-expert loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.moe.experts import GroupedExperts, grouped_mm_supported
from moetrain.model.moe.gemm_guard import grouped_mm_refusal, grouped_mm_refusal_for, torch_release

BF16 = torch.bfloat16
H200 = dict(device_type="cuda", dtype=BF16, capability=(9, 0), d_model=2048, hidden=1792)


def refusal(**kw) -> str | None:
    return grouped_mm_refusal(**{**H200, "torch_version": "2.13.0+cu128", **kw})


def test_hopper_bf16_aligned_shapes_run_grouped() -> None:
    assert refusal() is None


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(capability=(10, 0)), "PyTorch issue 172439"),
        (dict(capability=(10, 3)), "PyTorch issue 172439"),
        (dict(capability=(10, 0), sm100_fixed_in=(2, 14)), "PyTorch issue 172439"),
        (dict(capability=(8, 0)), "8.0: no fast grouped GEMM"),
        (dict(capability=(12, 0)), "12.0: no fast grouped GEMM"),
        (dict(capability=None), "capability unknown"),
        (dict(dtype=torch.float32), "bf16 only"),
        (dict(dtype=torch.float16), "bf16 only"),
        (dict(available=False), "has no torch.nn.functional.grouped_mm"),
        (dict(device_type="mps"), "not tested"),
    ],
)
def test_refused_devices(kw: dict, expected: str) -> None:
    why = refusal(**kw)
    assert why is not None and expected in why


def test_blackwell_runs_grouped_from_the_release_with_the_fix() -> None:
    blackwell = dict(capability=(10, 0), sm100_fixed_in=(2, 14))
    assert refusal(**blackwell, torch_version="2.14.0") is None
    assert refusal(**blackwell, torch_version="2.15.1+cu130") is None
    assert "172439" in refusal(**blackwell, torch_version="2.13.1")


@pytest.mark.parametrize(
    "d_model,hidden,dtype,operand",
    [
        (2048, 1436, BF16, "SwiGLU activation (N, F)"),  # 2F = 2872 is aligned, F is not
        (2048, 1434, BF16, "gate|up weights w13 (D, 2F)"),  # 2F = 2868: not a multiple of 8
        (2044, 1792, BF16, "routed tokens x (N, D)"),
        (2044, 1792, torch.float32, None),  # fp32 rows need a multiple of 4 only (CPU)
        (64, 5, torch.float32, "gate|up weights w13 (D, 2F)"),
        (64, 6, torch.float32, "SwiGLU activation (N, F)"),
    ],
)
def test_every_operand_stride_is_checked(
    d_model: int, hidden: int, dtype: torch.dtype, operand: str | None
) -> None:
    for device in ("cpu", "cuda"):
        if device == "cuda" and dtype != BF16:
            continue
        why = refusal(device_type=device, d_model=d_model, hidden=hidden, dtype=dtype)
        if operand is None:
            assert why is None
        else:
            assert why is not None and why.startswith(operand), why


def test_torch_release() -> None:
    assert torch_release("2.13.0+cpu") == (2, 13)
    assert torch_release("2.14.0a0+git1234") == (2, 14)
    with pytest.raises(ValueError, match="not a torch version"):
        torch_release("nightly")


def test_live_tensors_layout_and_alignment() -> None:
    w13, w2 = torch.zeros(2, 8, 32), torch.zeros(2, 16, 8)
    x = torch.zeros(5, 8)
    assert grouped_mm_refusal_for(x, w13, w2) is None
    assert "row-major" in grouped_mm_refusal_for(torch.zeros(8, 5).t(), w13, w2)
    offset = torch.zeros(5 * 8 + 1)[1:].view(5, 8)  # starts 4 bytes into its storage
    assert "16-byte boundary" in grouped_mm_refusal_for(offset, w13, w2)
    assert "not contiguous" in grouped_mm_refusal_for(x, torch.zeros(2, 32, 8).transpose(1, 2), w2)


def test_a_shape_the_kernel_refuses_falls_back_to_the_loop() -> None:
    d, f = 16, 12  # bf16: F = 12 is not a multiple of 8 (24-byte activation rows)
    torch.manual_seed(0)
    fast = GroupedExperts(3, d, f, grouped_mm=True)
    for w in fast.parameters():
        torch.nn.init.normal_(w, std=0.3)
    fast = fast.to(BF16)
    loop = GroupedExperts(3, d, f, grouped_mm=False).to(BF16)
    loop.load_state_dict(fast.state_dict())
    counts = torch.tensor([4, 0, 3])
    x = torch.randn(7, d, dtype=BF16)
    act = torch.randn(7, f, dtype=BF16)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="16 bytes"):  # what the guard keeps us from
        F.grouped_mm(act, fast.w2.detach(), offs=offs)
    assert not grouped_mm_supported(x, fast.w13, fast.w2)
    y = fast(x, counts)
    assert fast.path.startswith("loop: SwiGLU activation (N, F)")
    assert torch.equal(y, loop(x, counts))
    aligned = GroupedExperts(3, d, 16, grouped_mm=True).to(BF16)
    aligned(x, counts)
    assert aligned.path == "grouped_mm"
