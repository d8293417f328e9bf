"""Newton-Schulz in stacks (batched products into buffers) against the one-matrix-at-a-time
code it replaced, written out here in fp32, and against the float64 reference of test_muon;
stacks cut at STACK_ELEMENTS change no matrix's result."""

from __future__ import annotations

import pytest
import torch

import moetrain.optim.newton_schulz as ns
from moetrain.model.cpu_matmul import cpu_matmul_choice, use_cpu_matmul
from moetrain.optim.newton_schulz import DEFAULT_COEFFICIENTS, orthogonalize, orthogonalize_into
from tests.unit.test_muon import ns64


def one_at_a_time(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The earlier code: each matrix on its own, a new tensor per product, fp32."""
    a, b, c = DEFAULT_COEFFICIENTS
    out = torch.empty(g.shape)
    for i in range(g.shape[0]):
        x = g[i].mT if g.shape[-2] > g.shape[-1] else g[i]
        x = (x / (torch.linalg.matrix_norm(x) + ns.NORM_EPS)).contiguous()
        for _ in range(steps):
            gram = x @ x.mT
            x = ((gram @ gram.mT) * c + gram * b) @ x + x * a
        out[i] = x.mT if g.shape[-2] > g.shape[-1] else x
    return out


@pytest.fixture
def kernel(request):  # noqa: ANN001, ANN201
    """The model's fp32 CPU kernel set to ``request.param`` for the test."""
    saved = cpu_matmul_choice()
    use_cpu_matmul(request.param)
    yield request.param
    use_cpu_matmul(saved)


@pytest.mark.parametrize("kernel", ["torch", "onednn"], indirect=True)
@pytest.mark.parametrize("shape", [(5, 12, 40), (5, 40, 12), (3, 16, 16)])
def test_stacks_match_the_earlier_code_and_the_float64_reference(
    shape, kernel, monkeypatch
) -> None:
    """Within fp32 rounding of both (the stack cut into pieces of 2, 2 and 1 matrices), on
    torch's batched products and on oneDNN's one matrix at a time."""
    monkeypatch.setattr(ns, "STACK_ELEMENTS", 2 * shape[1] * shape[2])
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    got = orthogonalize(g, DEFAULT_COEFFICIENTS, 5)
    earlier = one_at_a_time(g)
    assert float((got - earlier).abs().max()) < 1e-5
    for i in range(shape[0]):
        want = ns64(g[i])
        assert float((got[i].double() - want).abs().max()) < 1e-5
        # a mistake far above that bound: one step fewer
        assert float((ns64(g[i], steps=4) - want).abs().max()) > 1e-2


def test_a_matrix_result_depends_on_neither_its_stack_nor_its_place(monkeypatch) -> None:
    """Bit for bit: each matrix alone, in a stack of 3, or last in a cut stack; scaled in place
    through a strided view."""
    g = torch.randn(7, 8, 24, generator=torch.Generator().manual_seed(4))
    alone = [orthogonalize(g[i : i + 1], DEFAULT_COEFFICIENTS, 5)[0] for i in range(7)]
    for per_stack in (3, 7):
        monkeypatch.setattr(ns, "STACK_ELEMENTS", per_stack * 8 * 24)
        stacked = orthogonalize(g, DEFAULT_COEFFICIENTS, 5)
        for i in range(7):
            assert torch.equal(stacked[i], alone[i]), (per_stack, i)
    wide = g.transpose(0, 1).clone()  # (8, 7, 24): the matrices strided in it
    view = wide.transpose(0, 1)
    orthogonalize_into(view, view, DEFAULT_COEFFICIENTS, 5, scale=3.0)
    for i in range(7):
        assert torch.equal(view[i], alone[i] * 3.0)
