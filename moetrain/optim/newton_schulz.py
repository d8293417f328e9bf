"""Newton-Schulz orthogonalisation: the quintic iteration Muon applies to its momentum.

``X <- X / ||X||_F``, then ``steps`` times ``A = X X^T; X <- a X + (b A + c A A) X`` on the wide
orientation (rows <= columns; a tall matrix is transposed first and back after), which drives
every singular value of X towards about 1 (between roughly 0.7 and 1.2 with the default
coefficients, Keller Jordan's (3.4445, -4.7750, 2.0315)) and keeps its singular vectors: the
result approximates ``U V^T`` of ``X = U S V^T``. Leading dimensions are a batch: a stack of
expert matrices is orthogonalised one matrix at a time, never as one matrix. Computed in fp32
whatever the input's dtype (returned in fp32); on CPU the products go through the model's fp32
kernel choice (:mod:`moetrain.model.cpu_matmul`, oneDNN by default).
"""

from __future__ import annotations

import torch

from moetrain.model.cpu_matmul import mm, onednn_runs

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NORM_EPS = 1e-7  # added to the Frobenius norm (a zero matrix stays zero)


def orthogonalize(
    g: torch.Tensor, coefficients: tuple[float, float, float] | list[float], steps: int
) -> torch.Tensor:
    """The orthogonalised ``g`` (..., rows, cols) in fp32, each trailing matrix on its own."""
    a, b, c = coefficients
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    # one memory layout for every matrix, however it was cut or batched: the products then
    # round alike, and a matrix's result does not depend on its batch
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)).contiguous()
    for _ in range(steps):
        gram = _matmul(x, x.mT)
        x = a * x + _matmul(b * gram + c * _matmul(gram, gram), x)
    return x.mT if tall else x


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over the same leading dims: one oneDNN product per matrix where it runs,
    else torch's batched one."""
    if not onednn_runs(a, b):
        return a @ b
    if a.ndim == 2:
        return mm(a, b)
    pairs = zip(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), strict=True)
    return torch.stack([mm(x, y) for x, y in pairs]).view(*a.shape[:-1], b.shape[-1])


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of :func:`orthogonalize` on one rows x cols
    matrix: per step the Gram matrix ``2 m^2 n``, its square ``2 m^3`` and the product with X
    ``2 m^2 n``, with m = min(rows, cols), n = max."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)
