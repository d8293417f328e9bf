"""The clamped SwiGLU's written-out gradient at and next to its clamps' bounds: a gate exactly
at the limit, an up projection exactly at either bound (the clamps pass the gradient there, as
torch's ``clamp`` does), one float inside and outside them, against autograd's composition of
torch ops in fp64, packed and as two halves (the shared expert's form), weighted and not."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.clamped_swiglu import clamped_swiglu, clamped_swiglu_packed


def _composition(a, b, w, alpha: float, limit: float, offset: float) -> torch.Tensor:
    a = a.clamp(max=limit)
    out = (b.clamp(-limit, limit) + offset) * (a * torch.sigmoid(alpha * a))
    return out if w is None else (out * w.unsqueeze(-1)).to(a.dtype)


def _at_the_bounds(dtype: torch.dtype, limit: float, rows: int, f: int) -> torch.Tensor:
    """(rows, 2f) values: random ones, with the bounds, their float neighbours and far values
    planted in both halves."""
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, 2 * f, generator=gen) * limit).to(dtype)
    lim = torch.tensor(limit, dtype=dtype)
    inf = torch.tensor(float("inf"), dtype=dtype)
    special = torch.stack(
        [lim, -lim, torch.nextafter(lim, inf), torch.nextafter(lim, -inf)]
        + [torch.nextafter(-lim, -inf), torch.nextafter(-lim, inf), 3 * lim, -3 * lim]
    )
    n = special.numel()
    h[:n, 0] = h[n : 2 * n, 1] = special  # in the gate half
    h[:n, f] = h[n : 2 * n, f + 3] = special  # in the up half
    return h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("alpha, limit, offset", [(1.0, 10.0, 0.0), (1.702, 0.7, 1.0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_gradient_at_the_bounds_is_the_fp64_references(dtype, alpha, limit, offset, weighted):
    h = _at_the_bounds(dtype, limit, 48, 40).requires_grad_()
    w = torch.rand(48, dtype=torch.float32, requires_grad=True) if weighted else None
    g = torch.randn(48, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    a, b = h.chunk(2, -1)
    assert (a == limit).any() and (b == -limit).any() and (b == limit).any()
    got = clamped_swiglu_packed(h, w, alpha, limit, offset)
    inputs = (h,) if w is None else (h, w)
    got_grads = torch.autograd.grad(got, inputs, g)
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    w64 = None if w is None else ref_in[1]
    want = _composition(*ref_in[0].chunk(2, -1), w64, alpha, limit, offset)
    want_grads = torch.autograd.grad(want, ref_in, g.double())
    tol = {"rtol": 3e-2, "atol": 3e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want.to(dtype), **tol)
    for mine, ref in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(mine, ref.to(mine.dtype), **tol)
        assert torch.equal(mine == 0, ref == 0)  # the clamps' masks, element for element


def test_the_two_halves_form_equals_the_packed_one() -> None:
    h = _at_the_bounds(torch.float32, 10.0, 32, 24)
    hp = h.clone().requires_grad_()
    a, b = (x.clone().requires_grad_() for x in h.chunk(2, -1))
    g = torch.randn(32, 24, generator=torch.Generator().manual_seed(2))
    packed = clamped_swiglu_packed(hp, None, 1.0, 10.0, 0.0)
    halves = clamped_swiglu(a, b, 1.0, 10.0, 0.0)
    assert torch.equal(packed, halves)
    packed.backward(g)
    halves.backward(g)
    # (to float rounding: torch's vectorized and scalar exp differ in the last bit)
    torch.testing.assert_close(hp.grad, torch.cat([a.grad, b.grad], -1))
