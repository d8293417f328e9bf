"""Newton-Schulz orthogonalisation: the quintic iteration Muon applies to its momentum.

``X <- X / ||X||_F``, then ``steps`` times ``A = X X^T; X <- a X + (b A + c A A) X`` on the wide
orientation (rows <= columns; a tall matrix is transposed first and back after), which drives
every singular value of X towards about 1 (between roughly 0.7 and 1.2 with the default
coefficients, Keller Jordan's (3.4445, -4.7750, 2.0315)) and keeps its singular vectors: the
result approximates ``U V^T`` of ``X = U S V^T``. Leading dimensions are a batch: a stack of
expert matrices is orthogonalised one matrix at a time, never as one matrix.

Computed in fp32 whatever the input's dtype, one matrix at a time (its temporaries are one
matrix's, whatever the batch), the scalings done in place on the products' results; on CPU the
products go through the model's fp32 kernel choice (:mod:`moetrain.model.cpu_matmul`, oneDNN
by default). Every matrix is copied into the same memory layout first (contiguous, wide),
however it was cut or batched: the products then round alike, and a matrix's result does not
depend on its batch or on the layout it came from. bf16 products are not an option on CPU:
without AVX-512 BF16 they run at about a seventh of fp32's rate
(``benchmarks/newton_schulz_kernels.py``), and the update's inputs stay fp32 by policy.
"""

from __future__ import annotations

import itertools

import torch

from moetrain.model.cpu_matmul import mm

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NORM_EPS = 1e-7  # added to the Frobenius norm (a zero matrix stays zero)


def orthogonalize(
    g: torch.Tensor, coefficients: tuple[float, float, float] | list[float], steps: int
) -> torch.Tensor:
    """The orthogonalised ``g`` (..., rows, cols) in fp32, each trailing matrix on its own."""
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    orthogonalize_into(out, g, coefficients, steps)
    return out


def orthogonalize_into(
    out: torch.Tensor,
    g: torch.Tensor,
    coefficients: tuple[float, float, float] | list[float],
    steps: int,
    scale: float = 1.0,
) -> None:
    """Write ``scale`` times the orthogonalised ``g`` (..., rows, cols) into ``out`` (of its
    shape, any strides; ``g`` itself allowed): each trailing matrix on its own."""
    a, b, c = coefficients
    *batch, rows, cols = g.shape
    tall = rows > cols
    m, n = (cols, rows) if tall else (rows, cols)
    sources, targets = (g.mT, out.mT) if tall else (g, out)
    x = torch.empty(m, n, dtype=torch.float32, device=g.device)
    for index in itertools.product(*map(range, batch)):
        x.copy_(sources[index])  # (the one layout: contiguous, wide)
        x.div_(torch.linalg.matrix_norm(x).add_(NORM_EPS))
        for _ in range(steps):
            gram = mm(x, x.mT)
            poly = mm(gram, gram.mT).mul_(c).add_(gram, alpha=b)  # (gram is symmetric)
            x = mm(poly, x).add_(x, alpha=a)
        targets[index].copy_(x.mul_(scale) if scale != 1.0 else x)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of :func:`orthogonalize` on one rows x cols
    matrix: per step the Gram matrix ``2 m^2 n``, its square ``2 m^3`` and the product with X
    ``2 m^2 n``, with m = min(rows, cols), n = max."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)
