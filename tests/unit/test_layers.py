"""The SwiGLU activations: same values and gradients as autograd's ``silu(a) * b``, less saved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.layers import silu_mul, silu_mul_packed


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def test_gradcheck_float64() -> None:
    torch.manual_seed(0)
    a, b = (torch.randn(7, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    h = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(silu_mul, (a, b))
    assert torch.autograd.gradcheck(silu_mul_packed, (h,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_autograd_composition(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    h = (torch.randn(64, 2 * 48) * 3).to(dtype).requires_grad_(True)
    grad = torch.randn(64, 48).to(dtype)
    a, b = h.detach().chunk(2, -1)
    ref_a, ref_b = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    want = _reference(ref_a, ref_b)
    want.backward(grad)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}

    got = silu_mul_packed(h)
    got.backward(grad)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(h.grad, torch.cat([ref_a.grad, ref_b.grad], -1), **tol)

    a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    got2 = silu_mul(a2, b2)
    got2.backward(grad.t().contiguous().t())  # a non-contiguous upstream gradient
    torch.testing.assert_close(got2, want, **tol)
    torch.testing.assert_close(a2.grad, ref_a.grad, **tol)
    torch.testing.assert_close(b2.grad, ref_b.grad, **tol)


def test_saves_only_its_inputs() -> None:
    h = torch.randn(32, 16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        silu_mul_packed(h)
    assert sum(t.numel() for t in saved) == h.numel()
    saved.clear()
    a, b = h.chunk(2, -1)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _reference(a, b)
    assert sum(t.numel() for t in saved) == 3 * a.numel()  # autograd also keeps silu(a)
