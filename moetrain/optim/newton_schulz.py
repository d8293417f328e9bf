"""Newton-Schulz orthogonalisation: the quintic iteration Muon applies to its momentum.

``X <- X / ||X||_F``, then ``steps`` times ``A = X X^T; X <- a X + (b A + c A A) X`` on the wide
orientation (rows <= columns; a tall matrix is transposed first and back after), which drives
every singular value of X towards about 1 (between roughly 0.7 and 1.2 with the default
coefficients, Keller Jordan's (3.4445, -4.7750, 2.0315)) and keeps its singular vectors: the
result approximates ``U V^T`` of ``X = U S V^T``. Leading dimensions are a batch: a stack of
expert matrices is orthogonalised one matrix at a time, never as one matrix.

Computed in fp32 whatever the input's dtype, as three batched products per step into four
buffers made once per call (the iterate, the next one, ``A`` and ``b A + c A A``), the scalings
folded into the products (``baddbmm``): about the time of the products alone, where one
product per matrix with a new tensor for every intermediate took 1.5x as long
(``benchmarks/muon_cost.py --kernels``). The products are torch's batched ones (MKL on CPU,
cuBLAS on a GPU), not the model's oneDNN choice (:mod:`moetrain.model.cpu_matmul`): oneDNN has
no batched product with an output buffer, and one call per matrix was slower here. Every matrix
is copied into the same memory layout first, however it was cut or batched: the products then
round alike, and a matrix's result does not depend on its batch or on the layout it came from.
"""

from __future__ import annotations

import torch

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
    x = torch.empty((*batch, m, n), dtype=torch.float32, device=g.device)
    if x.numel() == 0:
        return
    x.copy_(g.mT if tall else g)  # (the one layout: every matrix contiguous, wide)
    x = x.view(-1, m, n)
    x.div_(torch.linalg.matrix_norm(x, keepdim=True).add_(NORM_EPS))
    nxt = torch.empty_like(x)
    gram = x.new_empty(x.shape[0], m, m)
    poly = torch.empty_like(gram)
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(x, poly, x, beta=a, out=nxt)
        x, nxt = nxt, x
    if scale != 1.0:
        x.mul_(scale)
    x = x.view(*batch, m, n)
    (out.mT if tall else out).copy_(x)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of :func:`orthogonalize` on one rows x cols
    matrix: per step the Gram matrix ``2 m^2 n``, its square ``2 m^3`` and the product with X
    ``2 m^2 n``, with m = min(rows, cols), n = max."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)
