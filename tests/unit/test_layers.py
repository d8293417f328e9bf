"""RMSNorm and the SwiGLU activations: same values and gradients as autograd's composition, less
saved for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.layers import LayerNorm, RMSNorm, silu_mul, silu_mul_packed


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def test_gradcheck_float64() -> None:
    torch.manual_seed(0)
    a, b = (torch.randn(7, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    h = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(silu_mul, (a, b))
    assert torch.autograd.gradcheck(silu_mul_packed, (h,))
    w = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)  # a per-row weight
    assert torch.autograd.gradcheck(silu_mul_packed, (h, w))


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
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        silu_mul_packed(h, torch.rand(32, requires_grad=True))
    assert sum(t.numel() for t in saved) == h.numel() + 32
    saved.clear()
    a, b = h.chunk(2, -1)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _reference(a, b)
    assert sum(t.numel() for t in saved) == 3 * a.numel()  # autograd also keeps silu(a)


def _rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rmsnorm_gradcheck_float64() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(16).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_autograd_composition_and_saves_less(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(4, 9, 64) * 3).to(dtype).requires_grad_(True)
    grad = torch.randn(4, 9, 64).to(dtype)
    ref_x, ref_w = x.detach().clone().requires_grad_(True), norm.weight.detach().clone()
    ref_w.requires_grad_(True)
    want = _rmsnorm_reference(ref_x, ref_w, norm.eps)
    want.backward(grad)
    got = norm(x)
    got.backward(grad)
    tol = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same forward ops
    torch.testing.assert_close(x.grad, ref_x.grad, **tol)
    torch.testing.assert_close(norm.weight.grad, ref_w.grad, **tol)

    def saved_bytes(fn, inp: torch.Tensor) -> int:  # noqa: ANN001
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(inp)
        return sum(storages.values())

    row = x.shape[0] * x.shape[1]
    a = x.element_size()
    ours = saved_bytes(norm, x) - norm.weight.numel() * a
    assert ours == x.numel() * a + 4 * row  # x and the fp32 rsqrt per row, nothing else
    assert saved_bytes(lambda t: _rmsnorm_reference(t, norm.weight, norm.eps), x) > ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_matches_autograd_composition(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    h = (torch.randn(64, 2 * 48) * 3).to(dtype).requires_grad_(True)
    w = torch.rand(64).to(dtype).requires_grad_(True)
    grad = torch.randn(64, 48).to(dtype)
    h_ref, w_ref = (t.detach().float().requires_grad_(True) for t in (h, w))
    a, b = h_ref.chunk(2, -1)
    want = _reference(a, b) * w_ref.unsqueeze(-1)
    want.backward(grad.float())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}

    got = silu_mul_packed(h, w)
    got.backward(grad)
    assert got.dtype == h.grad.dtype == w.grad.dtype == dtype
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(h.grad.float(), h_ref.grad, **tol)
    # bf16: a row's weight gradient sums F rounded products; compare at its scale
    scale = w_ref.grad.abs().max().item()
    atol_w = tol["atol"] if dtype == torch.float32 else 2e-2 * scale
    torch.testing.assert_close(w.grad.float(), w_ref.grad, rtol=tol["rtol"], atol=atol_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_is_torchs_with_its_weight_and_bias(dtype: torch.dtype) -> None:
    """LayerNorm (model.norm: layernorm) is nn.LayerNorm's formula, mean and biased variance
    with a weight and a bias: in fp32 bit for bit, in bf16 computed in fp32 and rounded once;
    its gradients reach weight, bias and input."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 24, generator=g) * 3 + 1).to(dtype).requires_grad_()
    norm = LayerNorm(24, eps=1e-6)
    ref = torch.nn.LayerNorm(24, eps=1e-6)
    with torch.no_grad():
        for p, q in ((norm.weight, ref.weight), (norm.bias, ref.bias)):
            p.uniform_(0.5, 1.5, generator=g)
            q.copy_(p)
    got = norm(x)
    want = ref(x.detach().float()).to(dtype)
    assert got.dtype == dtype
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    got.float().square().sum().backward()
    assert all(t.grad.abs().max() > 0 for t in (x, norm.weight, norm.bias))
