"""When the experts may use ``torch.nn.functional.grouped_mm`` (one kernel for all experts).

:func:`grouped_mm_refusal` takes the device, dtype, compute capability, shapes and torch version
as plain inputs and returns why the fast path must not run (None when it may), so every rule is
unit-tested without a GPU. :func:`grouped_mm_refusal_for` applies it to live tensors, adding the
checks only they can answer (layout and 16-byte aligned data pointers).

The rules, read in torch's sources (``GroupedMMUtils.h``, ``cuda/Blas.cpp``):
- CUDA: bf16 only (other dtypes take torch's per-group fallback, which copies the offsets to
  the host every call); compute capability 9.0 (Hopper). On Blackwell (10.x) the kernel gives
  non-zero weight gradients to experts that received no tokens (PyTorch issue 172439, open), so
  10.x is refused until :data:`SM100_FIXED_IN` names the torch release with the fix. Other
  GPUs have no fast kernel (torch itself would fall back to its per-group loop).
- Every operand, on any device: a row-major or column-major matrix whose leading stride is a
  multiple of 16 bytes, i.e. D, 2F and F multiples of 16 / element size (8 in bf16). F matters
  on its own: the SwiGLU activation (N, F) and its transpose feed the down projection and its
  weight gradient, so an F like 1436 (2F = 2872 is aligned, F is not) raises inside the kernel.
- CPU: any dtype torch accepts (fp32 and bf16 tested), with the same stride rule.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

SM100_FIXED_IN: tuple[int, int] | None = None
"""First torch release (major, minor) whose grouped GEMM gives zero weight gradients to experts
without tokens on compute capability 10.x (PyTorch issue 172439). None while the issue is open:
then only 9.0 runs the fast path on CUDA."""

# (operand of the experts' forward or backward GEMMs, its leading dimension)
OPERANDS = (
    ("routed tokens x (N, D) and x^T", "D"),
    ("gate|up weights w13 (D, 2F) and w13^T", "2F"),
    ("gate|up output h (N, 2F) and its gradient", "2F"),
    ("SwiGLU activation (N, F) and its transpose", "F"),
    ("down weights w2 (F, D) and w2^T", "D"),
    ("expert output gradient (N, D)", "D"),
)


def torch_release(version: str) -> tuple[int, int]:
    """``"2.13.0+cu128"`` -> ``(2, 13)``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def grouped_mm_refusal(
    *,
    device_type: str,
    dtype: torch.dtype,
    d_model: int,
    hidden: int,
    capability: tuple[int, int] | None = None,
    torch_version: str = torch.__version__,
    available: bool | None = None,
    sm100_fixed_in: tuple[int, int] | None = SM100_FIXED_IN,
) -> str | None:
    """Why the experts must not use ``F.grouped_mm`` here; None when they may.

    ``capability``: the CUDA compute capability (needed for ``device_type="cuda"``);
    ``available``: whether this torch has ``F.grouped_mm`` (default: look it up).
    """
    if available is None:
        available = hasattr(F, "grouped_mm")
    if not available:
        return f"torch {torch_version} has no torch.nn.functional.grouped_mm"
    if device_type == "cuda":
        if dtype != torch.bfloat16:
            return f"CUDA grouped GEMM runs bf16 only, not {dtype}"
        if capability is None:
            return "CUDA compute capability unknown"
        if capability[0] == 10:
            if sm100_fixed_in is None or torch_release(torch_version) < sm100_fixed_in:
                return (
                    f"compute capability {capability[0]}.{capability[1]}: grouped GEMM gives "
                    "non-zero weight gradients to experts without tokens (PyTorch issue 172439)"
                )
        elif capability != (9, 0):
            return f"compute capability {capability[0]}.{capability[1]}: no fast grouped GEMM"
    elif device_type != "cpu":
        return f"device {device_type}: grouped GEMM not tested there"
    align = 16 // dtype.itemsize
    sizes = {"D": d_model, "2F": 2 * hidden, "F": hidden}
    for operand, dim in OPERANDS:
        if sizes[dim] % align:
            return (
                f"{operand}: leading stride {dim}={sizes[dim]} is not a multiple of {align} "
                f"elements (16 bytes in {dtype})"
            )
    return None


def grouped_mm_refusal_for(x_ND: torch.Tensor, *weights: torch.Tensor) -> str | None:
    """:func:`grouped_mm_refusal` for live tensors: the routed rows ``x_ND`` and the stacked
    weights ``w13`` (L, D, 2F), ``w2`` (L, F, D); also checks that x is row-major and that
    every operand that is passed as it is starts on a 16-byte boundary."""
    w13 = weights[0]
    cap = None
    if x_ND.is_cuda:
        cap = torch.cuda.get_device_capability(x_ND.device)
    why = grouped_mm_refusal(
        device_type=x_ND.device.type,
        dtype=x_ND.dtype,
        d_model=w13.shape[-2],
        hidden=w13.shape[-1] // 2,
        capability=cap,
    )
    if why is not None:
        return why
    if x_ND.shape[0] > 0 and (x_ND.stride(-1) != 1 or x_ND.stride(0) != x_ND.shape[1]):
        return f"routed tokens x not row-major (strides {tuple(x_ND.stride())})"
    for w in weights:  # a weight in another dtype is passed as a fresh (contiguous) copy
        if w.dtype == x_ND.dtype and not w.is_contiguous():
            return f"a {tuple(w.shape)} expert weight is not contiguous"
    for t in (x_ND, *weights):
        if t.dtype == x_ND.dtype and t.numel() and t.data_ptr() % 16:
            return f"a {tuple(t.shape)} operand does not start on a 16-byte boundary"
    return None
