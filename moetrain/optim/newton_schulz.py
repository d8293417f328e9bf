"""Newton-Schulz orthogonalisation: the quintic iteration Muon applies to its momentum.

``X <- X / ||X||_F``, then ``steps`` times ``A = X X^T; X <- a X + (b A + c A A) X`` on the wide
orientation (rows <= columns; a tall matrix is transposed first and back after), which drives
every singular value of X towards about 1 (between roughly 0.7 and 1.2 with the default
coefficients, Keller Jordan's (3.4445, -4.7750, 2.0315)) and keeps its singular vectors: the
result approximates ``U V^T`` of ``X = U S V^T``. Every matrix is orthogonalised on its own,
never a stack of them as one matrix.

Computed in fp32 whatever the input's dtype. The matrices of a batch (an expert parameter's)
go through together: up to :data:`STACK_ELEMENTS` values at a time are copied into one
contiguous stack, and each step is three batched products into buffers made once per call, the
scalings folded into the products (``torch.bmm`` / ``baddbmm``: one product per matrix of the
stack, each by the same kernel whatever the stack; 0.90x the CPU time of one matrix at a time
with a new tensor per product, ``benchmarks/newton_schulz_kernels.py``). Every matrix is
copied into the same layout first (contiguous, wide), however it was cut or batched: a
matrix's result depends neither on its stack nor on the layout it came from. Where the model's
fp32 CPU kernel is oneDNN (:mod:`moetrain.model.cpu_matmul`: AVX-512 CPUs) the products are
oneDNN's, one matrix at a time, into the same buffers. bf16 products are not an option on CPU:
without AVX-512 BF16 they run at about a seventh of fp32's rate, and the update's inputs stay
fp32 by policy.
"""

from __future__ import annotations

import itertools

import torch

from moetrain.model.cpu_matmul import mm, onednn_runs

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NORM_EPS = 1e-7  # added to the Frobenius norm (a zero matrix stays zero)
STACK_ELEMENTS = 1 << 18
"""fp32 values orthogonalised at once (at least one matrix): a stack and its next iterate, 1 MiB
each, and two stacks of Gram matrices of at most that (two of the benchmark's expert matrices:
about a matrix's temporaries more than one matrix at a time)."""

Coefficients = tuple[float, float, float] | list[float]


def orthogonalize(g: torch.Tensor, coefficients: Coefficients, steps: int) -> torch.Tensor:
    """The orthogonalised ``g`` (..., rows, cols) in fp32, each trailing matrix on its own."""
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    orthogonalize_into(out, g, coefficients, steps)
    return out


def orthogonalize_into(
    out: torch.Tensor,
    g: torch.Tensor,
    coefficients: Coefficients,
    steps: int,
    scale: float = 1.0,
) -> None:
    """Write ``scale`` times the orthogonalised ``g`` (..., rows, cols) into ``out`` (of its
    shape, any strides; ``g`` itself allowed): each trailing matrix on its own."""
    *batch, rows, cols = g.shape
    tall = rows > cols
    m, n = (cols, rows) if tall else (rows, cols)
    sources, targets = (g.mT, out.mT) if tall else (g, out)
    index = list(itertools.product(*map(range, batch)))
    per_stack = min(len(index), max(1, STACK_ELEMENTS // (m * n)))
    x = torch.empty(per_stack, m, n, dtype=torch.float32, device=g.device)
    buffers = (torch.empty_like(x), x.new_empty(per_stack, m, m), x.new_empty(per_stack, m, m))
    for at in range(0, len(index), per_stack):
        chunk = index[at : at + per_stack]
        for i, matrix in enumerate(chunk):
            x[i].copy_(sources[matrix])  # (the one layout: contiguous, wide)
        k = len(chunk)
        done = _iterate(x[:k], [buf[:k] for buf in buffers], coefficients, steps)
        if scale != 1.0:
            done.mul_(scale)
        for i, matrix in enumerate(chunk):
            targets[matrix].copy_(done[i])


def _iterate(
    x: torch.Tensor, buffers: list[torch.Tensor], coefficients: Coefficients, steps: int
) -> torch.Tensor:
    """The iteration on the stack ``x`` (k, m, n), normalised in place; ``buffers``: another
    (k, m, n) and two (k, m, m). -> the stack that holds the result (``x`` or the other)."""
    a, b, c = coefficients
    nxt, gram, poly = buffers
    x.div_(torch.linalg.matrix_norm(x, keepdim=True).add_(NORM_EPS))
    per_matrix = onednn_runs(x)
    for _ in range(steps):
        if per_matrix:  # (oneDNN: no batched product; its scalings after each product)
            for i in range(len(x)):
                gram[i].copy_(mm(x[i], x[i].mT))
                poly[i].copy_(mm(gram[i], gram[i])).mul_(c).add_(gram[i], alpha=b)
                nxt[i].copy_(mm(poly[i], x[i])).add_(x[i], alpha=a)
        else:
            torch.bmm(x, x.mT, out=gram)
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)  # (gram is symmetric)
            torch.baddbmm(x, poly, x, beta=a, out=nxt)
        x, nxt = nxt, x
    return x


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of :func:`orthogonalize` on one rows x cols
    matrix: per step the Gram matrix ``2 m^2 n``, its square ``2 m^3`` and the product with X
    ``2 m^2 n``, with m = min(rows, cols), n = max."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)
