"""fp32 matrix multiplies on CPU through oneDNN: the one owner of which kernel multiplies them.

torch multiplies fp32 matrices on CPU with MKL's sgemm, which does not use AVX-512 on AMD
processors; oneDNN, which torch also ships, uses the widest vector unit the CPU has (on an
AVX-512 AMD EPYC, one thread: ~200 GFLOP/s against MKL's ~90 at the model's GEMM shapes;
``benchmarks/step_floor.py`` measures both). Both compute every product in
fp32 with fp32 accumulation; only the order of the additions differs.

:func:`mm`, :func:`linear` (and :class:`Linear`) and :func:`grouped_mm` run oneDNN's inner
product, forward and backward, when every operand is an fp32 CPU tensor, torch has oneDNN and
the choice is ``"onednn"`` (:func:`use_cpu_matmul`, from ``train.cpu_matmul``; the module's
default, and what ``"auto"``, the config's default, picks where torch's CPU capability is
AVX-512: :func:`preferred_kernel`),
except the small products of inference (:func:`kernel_per_shape_pays`). Anywhere else (GPUs, bf16, ``"torch"``) they are torch's own ``@``, ``F.linear`` and
``F.grouped_mm`` with torch's autograd. :func:`add_product_` stays on torch's kernel.

Shape legend: N rows, K inner dimension, O output columns, L groups (experts).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_CACHE = 32
"""Shapes whose kernels oneDNN keeps (both of its caches; the environment's
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` win). Their default, 1024
kernels of about 1 MiB each, grows a training process by hundreds of MiB as the expert GEMMs'
shapes change from step to step; a step of the benchmark's model uses 15. Read by oneDNN
on its first use in the process, so set at import."""
for _name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_name, str(KERNEL_CACHE))

CHOICES = ("auto", "onednn", "torch")
_choice = "onednn"


def preferred_kernel() -> str:
    """``"onednn"`` where torch's CPU capability is AVX-512, else ``"torch"``: oneDNN's gain is
    its AVX-512 code; on an AVX2-only AMD EPYC it measured 1.0-1.3x slower than MKL on single
    GEMMs and 1.7-2x slower on the experts' grouped GEMM (fwd + bwd, in tiles) than torch's."""
    return "onednn" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "torch"


def use_cpu_matmul(choice: str) -> None:
    """Set the kernel for fp32 CPU matrix multiplies in this process: ``"onednn"``,
    ``"torch"`` (MKL, torch's default) or ``"auto"`` (:func:`preferred_kernel`)."""
    global _choice
    if choice not in CHOICES:
        raise ValueError(f"cpu_matmul must be one of {CHOICES}; got {choice!r}")
    _choice = preferred_kernel() if choice == "auto" else choice


def cpu_matmul_choice() -> str:
    """The kernel set by :func:`use_cpu_matmul` (``"onednn"`` unless set)."""
    return _choice


def onednn_runs(*tensors: torch.Tensor) -> bool:
    """Whether a multiply of ``tensors`` goes through oneDNN (see the module docstring)."""
    return (
        _choice == "onednn"
        and torch.backends.mkldnn.is_available()
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    )


def _inner_product(
    x_NK: torch.Tensor, w_OK: torch.Tensor, b_O: torch.Tensor | None = None
) -> torch.Tensor:
    """``x_NK @ w_OK.T (+ b_O)`` by oneDNN (any strides; a new contiguous tensor); torch's
    ``F.linear`` when K = 0, which oneDNN refuses."""
    if x_NK.shape[-1] == 0:
        return F.linear(x_NK, w_OK, b_O)
    return torch.ops.mkldnn._linear_pointwise(x_NK, w_OK, b_O, "none", [], "")


def mm(a_NK: torch.Tensor, b_KO: torch.Tensor) -> torch.Tensor:
    """``a_NK @ b_KO`` without autograd (inside an autograd Function's forward or backward)."""
    if onednn_runs(a_NK, b_KO):
        return _inner_product(a_NK, b_KO.t())
    return a_NK @ b_KO


def add_product_(out: torch.Tensor, a_NK: torch.Tensor, b_KO: torch.Tensor) -> torch.Tensor:
    """``out += a_NK @ b_KO`` in place (``out`` may be fp32 for lower-precision operands), by
    torch's kernel on every path: oneDNN would first copy a transposed ``a_NK`` into its own
    layout, and the LM head's weight gradient reads the (C, V) logits gradient transposed, so
    that copy is as large as the logits and comes at the step's memory peak (+36 MiB at C 1024,
    V 8192, to save a sixth of the product's time)."""
    if out.dtype == a_NK.dtype:
        return out.addmm_(a_NK, b_KO)
    return out.add_(a_NK @ b_KO)


class _Linear(torch.autograd.Function):
    """``x @ w.T (+ b)`` over the last dimension of ``x``, every GEMM by oneDNN."""

    @staticmethod
    def forward(ctx, x, w, b):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        y = _inner_product(x.reshape(-1, x.shape[-1]), w, b)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        g_NO = grad.reshape(-1, w.shape[0]).contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _inner_product(g_NO, w.t()).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _inner_product(g_NO.t(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g_NO.sum(0)
        return grad_x, grad_w, grad_b


def kernel_per_shape_pays(rows: int) -> bool:
    """Whether a product of ``rows`` rows is worth oneDNN's kernel for its shape: always with
    autograd on (training's shapes repeat every step and their kernels are kept); without it,
    from :data:`TILE_ROWS` rows up. Inference (``generate``) changes the row count on every
    token, so oneDNN would build a new kernel (milliseconds) for nearly every product, each
    of which takes microseconds on torch's kernel."""
    return torch.is_grad_enabled() or rows >= TILE_ROWS


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``."""
    rows = x.numel() // max(x.shape[-1], 1)
    if kernel_per_shape_pays(rows) and onednn_runs(x, w, *(() if b is None else (b,))):
        return _Linear.apply(x, w, b)
    return F.linear(x, w, b)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict keys) whose multiplies follow this
    module's kernel choice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


TILE_ROWS = 128
"""Rows of each expert GEMM call: oneDNN builds (JIT-compiles) a kernel per GEMM shape and
keeps it, while an expert's row count changes every step. Calls of exactly this many rows
(the last of a group reads past the group's end, or back into it, and drops the extra rows;
fewer rows than a tile in all are padded with zeros to one; weight gradients sum zero-padded
pieces) keep the shapes few and the kernels reused."""


def _rows_by_tiles(
    a_NK: torch.Tensor, w_OK: torch.Tensor, out_NO: torch.Tensor, s: int, e: int
) -> None:
    """``out_NO[s:e] = a_NK[s:e] @ w_OK.T`` in calls of ``TILE_ROWS`` rows of ``a_NK`` (zero
    rows appended when it has fewer)."""
    n_all = a_NK.shape[0]
    if n_all < TILE_ROWS:
        padded = a_NK.new_zeros(TILE_ROWS, a_NK.shape[1])
        padded[:n_all] = a_NK
        a_NK, n_all = padded, TILE_ROWS
    tile = TILE_ROWS
    p = s
    while p < e:
        window = min(p, n_all - tile)
        stop = min(window + tile, e)
        out_NO[p:stop] = _inner_product(a_NK[window : window + tile], w_OK)[
            p - window : stop - window
        ]
        p = stop


def _weight_grad_by_tiles(a_KN: torch.Tensor, b_NO: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """``a_KN[:, s:e] @ b_NO[s:e]`` as a sum over ``TILE_ROWS`` rows at a time (the last piece
    zero-padded)."""
    total = None
    for p in range(s, e, TILE_ROWS):
        stop = min(p + TILE_ROWS, e)
        a_piece, b_piece = a_KN[:, p:stop], b_NO[p:stop]
        if stop - p < TILE_ROWS:
            a_pad = a_KN.new_zeros(TILE_ROWS, a_KN.shape[0])
            a_pad[: stop - p] = a_piece.t()
            b_pad = b_NO.new_zeros(TILE_ROWS, b_NO.shape[1])
            b_pad[: stop - p] = b_piece
            a_piece, b_piece = a_pad.t(), b_pad
        product = _inner_product(a_piece, b_piece.t())
        total = product if total is None else total.add_(product)
    return total


def _grouped(a: torch.Tensor, b: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offs_L)`` by oneDNN, no autograd, for the experts' two forms:
    a (N, K) x b (L, K, O) -> (N, O), group ``l`` the rows ``offs[l-1]:offs[l]`` of ``a``; and
    a (K, N) x b (N, O) -> (L, K, O), group ``l`` those columns of ``a`` and rows of ``b``
    (zeros for an empty group)."""
    ends = offs_L.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[2])
        out[ends[-1] if ends else 0 :] = 0  # rows after the last group, as F.grouped_mm
        for l_, (s, e) in enumerate(zip(starts, ends, strict=True)):
            _rows_by_tiles(a, b[l_].t(), out, s, e)
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    for l_, (s, e) in enumerate(zip(starts, ends, strict=True)):
        if e > s:
            out[l_] = _weight_grad_by_tiles(a, b, s, e)
    return out


class _GroupedMM(torch.autograd.Function):
    """(N, K) x (L, K, O) -> (N, O) per group of rows, every GEMM by oneDNN."""

    @staticmethod
    def forward(ctx, a_NK, b_LKO, offs_L):  # noqa: ANN001, ANN205
        ctx.save_for_backward(a_NK, b_LKO, offs_L)
        return _grouped(a_NK, b_LKO, offs_L)

    @staticmethod
    def backward(ctx, grad_NO):  # noqa: ANN001, ANN205
        a_NK, b_LKO, offs_L = ctx.saved_tensors
        grad_NO = grad_NO.contiguous()  # e.g. expanded after .sum(): one layout, one kernel
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _grouped(grad_NO, b_LKO.transpose(1, 2), offs_L)
        if ctx.needs_input_grad[1]:
            grad_b = _grouped(a_NK.t(), grad_NO, offs_L)
        return grad_a, grad_b, None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offs_L)`` for a (N, K) x b (L, K, O) -> (N, O) (with autograd)
    and a (K, N) x b (N, O) -> (L, K, O) (without)."""
    if not onednn_runs(a, b) or (b.dim() == 3 and not kernel_per_shape_pays(a.shape[0])):
        return F.grouped_mm(a, b, offs=offs_L)
    if b.dim() == 3 and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _GroupedMM.apply(a, b, offs_L)
    return _grouped(a, b, offs_L)
