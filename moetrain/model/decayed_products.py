"""Decayed pair products inside a chunk: the intra-chunk matrices of the chunked gated delta rule.

Shape legend: ... any leading dims (chunks, batch, heads), C chunk length, K key dim, G the
decay's channel dim: 1 when the decay is per head (Gated DeltaNet), K when it is per key
channel (Kimi Delta Attention).

For rows ``x`` (..., C, K), columns ``y`` (..., C, K) and the within-chunk cumulative log decay
``gam`` (..., C, G) (non-increasing along C, since log decays are <= 0), the product is

    M[t, i] = sum_c x[t, c] * y[i, c] * exp(gam[t, c] - gam[i, c])   where keep[t, i], else 0,

``keep`` being lower triangular (i <= t) and true only within one document. Every exponent
taken is <= 0, so nothing overflows: per head, ``exp(gam[t] - gam[i])`` is one (C, C) matrix
that scales ``x @ y.T``; per channel the decay does not factor out of the sum, so the chunk is
cut into blocks of at most 16 rows: a block's columns left of it are one matmul of
``x * exp(gam - gam[s])`` and ``y * exp(gam[s] - gam)`` with ``s`` the block's first row (both
factors <= 1), and the block's own lower triangle is summed column by column.

The gradient needs no M: scaling row t of ``x`` by ``exp(d)`` is the same as adding d to row
t's decay, so ``d gam = sum over the decay's channels of (x * dx - y * dy)`` (the caller adds
it up; :func:`decay_grad`).
"""

from __future__ import annotations

import math

import torch

BLOCK = 16  # rows of a diagonal block under a per-channel decay


def _block_rows(c: int) -> int:
    """The largest divisor of the chunk length ``c`` that is at most :data:`BLOCK`."""
    return max(d for d in range(1, min(c, BLOCK) + 1) if c % d == 0)


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` of log decays ``x`` <= 0, in place, with every factor below e^20 times the
    dtype's smallest normal number (5e-30 in fp32) set to exactly 0: far below any rounding of
    the sums these factors enter, while subnormal numbers would slow every multiplication they
    take part in a hundredfold on CPUs (strong decays over a chunk reach them)."""
    return _masked_exp_(x, x >= _cut(x.dtype))


def _cut(dtype: torch.dtype) -> float:
    """The log decay below which :func:`decay_exp` gives exactly 0."""
    return math.log(torch.finfo(dtype).tiny) + 20.0


def _masked_exp_(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` where ``ok``, exactly 0 elsewhere, in place: the exponent clamped into
    [cut, 0] first and the factor zeroed by a multiply (an exponential of far-below-range or
    infinite inputs, or a masked fill, costs several times a plain exponential on CPUs)."""
    return x.clamp_(_cut(x.dtype), 0.0).exp_().mul_(ok)


def pair_decay(gam: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(..., C, C): ``exp(gam[t] - gam[i])`` where ``keep`` (as :func:`decay_exp` rounds it), 0
    elsewhere, for a per-head decay ``gam`` (..., C, 1): the factor of every product of the
    chunk (:func:`decayed_products`' and :func:`decayed_products_grad`'s ``decay``)."""
    d = gam - gam.mT
    return _masked_exp_(d, (d >= _cut(d.dtype)) & keep)


def decayed_products(
    x: torch.Tensor,
    y: torch.Tensor,
    gam: torch.Tensor,
    keep: torch.Tensor,
    decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """M (..., C, C) as the module docstring defines it; under a per-head decay ``decay`` may
    be :func:`pair_decay`'s factor, computed once for several products of one chunk."""
    if gam.shape[-1] == 1:
        return (x @ y.mT).mul_(pair_decay(gam, keep) if decay is None else decay)
    c = x.shape[-2]
    b = _block_rows(c)
    out = x.new_zeros(*x.shape[:-1], c)
    for s in range(b, c, b):
        ref = gam[..., s : s + 1, :]
        xs = x[..., s : s + b, :] * decay_exp(gam[..., s : s + b, :] - ref)
        ys = y[..., :s, :] * decay_exp(ref - gam[..., :s, :])
        out[..., s : s + b, :s] = xs @ ys.mT
    diag = _diagonal_blocks(out, b)
    xb, yb, gb = (t.unflatten(-2, (c // b, b)) for t in (x, y, gam))
    for j in range(b):
        f = decay_exp(gb[..., j:, :] - gb[..., j : j + 1, :])
        diag[..., j:, j] = (xb[..., j:, :] * yb[..., j : j + 1, :] * f).sum(-1)
    return out.mul_(keep)  # (a multiply: several times cheaper than a masked fill on CPUs)


def decayed_products_grad(
    x: torch.Tensor,
    y: torch.Tensor,
    gam: torch.Tensor,
    keep: torch.Tensor,
    dm: torch.Tensor,
    decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dy) of :func:`decayed_products` for its gradient ``dm`` (..., C, C), which must be
    zero where ``keep`` is false; ``decay`` as there."""
    if gam.shape[-1] == 1:
        dmd = dm * (pair_decay(gam, keep) if decay is None else decay)
        return dmd @ y, dmd.mT @ x
    c = x.shape[-2]
    b = _block_rows(c)
    dx, dy = torch.zeros_like(x), torch.zeros_like(y)
    for s in range(b, c, b):
        ref = gam[..., s : s + 1, :]
        fx = decay_exp(gam[..., s : s + b, :] - ref)
        fy = decay_exp(ref - gam[..., :s, :])
        blk = dm[..., s : s + b, :s]
        dx[..., s : s + b, :] += (blk @ (y[..., :s, :] * fy)).mul_(fx)
        dy[..., :s, :] += (blk.mT @ (x[..., s : s + b, :] * fx)).mul_(fy)
    diag = _diagonal_blocks(dm, b)
    xb, yb, gb = (t.unflatten(-2, (c // b, b)) for t in (x, y, gam))
    dxb, dyb = dx.unflatten(-2, (c // b, b)), dy.unflatten(-2, (c // b, b))
    for j in range(b):
        f = decay_exp(gb[..., j:, :] - gb[..., j : j + 1, :])
        col = diag[..., j:, j].unsqueeze(-1) * f
        dxb[..., j:, :] += col * yb[..., j : j + 1, :]
        dyb[..., j, :] += (col * xb[..., j:, :]).sum(-2)
    return dx, dy


def _diagonal_blocks(m: torch.Tensor, b: int) -> torch.Tensor:
    """A writable view (..., C / b, b, b) of the b x b blocks on the diagonal of ``m`` (..., C, C)."""
    c = m.shape[-1]
    blocks = m.unflatten(-1, (c // b, b)).unflatten(-3, (c // b, b))  # (..., n, b, n, b)
    return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def decay_grad(*pairs: tuple[torch.Tensor, torch.Tensor], channels: int) -> torch.Tensor:
    """``sum of a * da`` over ``pairs`` of a decay-scaled tensor and its gradient, reduced to the
    decay's ``channels`` (1: summed over the last dim): the gradient of the log decay that
    scales them (pass ``(-a, da)`` for a tensor scaled by ``exp(-gam)``)."""
    out = sum(a * da for a, da in pairs)
    return out.sum(-1, keepdim=True) if channels == 1 else out
