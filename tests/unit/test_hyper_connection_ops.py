"""The hyper-connections' hand-written operations (``moetrain.model.hyper_connection_ops``):
their backward against finite differences in float64 (``gradcheck``), their fp32 values and
gradients against the plain autograd formulas evaluated in float64."""

from __future__ import annotations

import torch
from torch.autograd import gradcheck

from moetrain.model.attention import unit_rms
from moetrain.model.hyper_connection_ops import (
    _NormedProjection,
    collapse,
    mix,
    mixing_matrix,
    normed_projection,
)

T, N, D, ITERS, EPS = 6, 4, 8, 20, 1e-6


def plain_mixing_matrix(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The softmax and Sinkhorn-Knopp written out with autograd's own operations."""
    x = torch.softmax(logits, -1) + eps
    x = x / (x.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(-1, keepdim=True) + eps)
        x = x / (x.sum(-2, keepdim=True) + eps)
    return x


def _leaves(*shapes: tuple[int, ...], seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(True) for s in shapes]


def _matrices(t: int, n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Doubly stochastic-ish (T, N, N) matrices, made by a softmax over the last axis."""
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(t, n, n, generator=gen, dtype=dtype), -1).requires_grad_()


def test_backwards_match_finite_differences() -> None:
    t, n, d = 3, 3, 4  # (small: one forward per input entry)
    x, fn, y, post, pre = _leaves(
        (t, n * d), (2, n * d), (t, d), (t, n), (t, n), seed=0, dtype=torch.float64
    )
    assert gradcheck(lambda a, b: normed_projection(a, b, EPS), (x, fn), fast_mode=True)
    assert gradcheck(
        lambda c: mixing_matrix(c, 3, EPS),
        _leaves((t, n, n), seed=1, dtype=torch.float64),
        fast_mode=True,
    )
    streams = x.detach().view(t, n, d).requires_grad_()
    assert gradcheck(collapse, (streams, pre), fast_mode=True)
    assert gradcheck(mix, (streams, y, post, _matrices(t, n, 2, torch.float64)), fast_mode=True)


def test_finite_differences_catch_a_wrong_backward() -> None:
    """Negative control: the projection's backward without the RMS factor's own derivative."""

    class Unscaled(_NormedProjection):
        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            x, fn, r, _ = ctx.saved_tensors
            return torch.mm(g * r, fn), torch.mm((g * r).t(), x), None

    x, fn = _leaves((2, 6), (2, 6), seed=0, dtype=torch.float64)
    assert not gradcheck(
        lambda a, b: Unscaled.apply(a, b, EPS), (x, fn), fast_mode=True, raise_exception=False
    )


def test_fp32_values_and_gradients_match_the_plain_formulas_in_fp64() -> None:
    """Each operation in fp32 against the formulas it replaces (the normalised copy times
    ``fn``; the softmax and Sinkhorn divided out with autograd; the weighted sums with broadcasting) in
    float64: values and gradients equal up to fp32 rounding."""
    x, fn, y, post, pre = _leaves(
        (T, N * D), (3, N * D), (T, D), (T, N), (T, N), seed=3, dtype=torch.float32
    )
    comb = _matrices(T, N, 4, torch.float32)
    (logits,) = _leaves((T, N, N), seed=4, dtype=torch.float32)
    streams = x.view(T, N, D)

    def ours() -> list[torch.Tensor]:
        return [
            normed_projection(x, fn, EPS),
            mixing_matrix(logits, ITERS, EPS),
            collapse(streams, pre),
            mix(streams, y, post, comb),
        ]

    def plain(x, fn, y, post, pre, comb, logits):  # noqa: ANN001, ANN202
        s = x.view(T, N, D)
        mixed = (comb.unsqueeze(-1) * s.unsqueeze(2)).sum(1) + post.unsqueeze(-1) * y.unsqueeze(1)
        return [
            unit_rms(x, EPS) @ fn.t(),
            plain_mixing_matrix(logits, ITERS, EPS),
            (pre.unsqueeze(-1) * s).sum(1),
            mixed,
        ]

    leaves = [x, fn, y, post, pre, comb, logits]
    wide = [t.detach().double().requires_grad_() for t in leaves]
    got, want = ours(), plain(*wide)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.float(), rtol=1e-6, atol=1e-6)
    weights = _leaves(*[w.shape for w in want], seed=5, dtype=torch.float64)
    sum(((g * w.float()).sum() for g, w in zip(got, weights, strict=True))).backward()
    sum(((p * w).sum() for p, w in zip(want, weights, strict=True))).backward()
    for leaf, wide_leaf in zip(leaves, wide, strict=True):
        torch.testing.assert_close(leaf.grad, wide_leaf.grad.float(), rtol=1e-5, atol=1e-5)
