"""The MoE options gpt-oss needs, each against an explicit reference: the clamped SwiGLU
(``moe.activation``), expert biases (``moe.expert_biases``) in the grouped and the loop path
(and with the activation recomputed in backward), the router bias (``moe.router_bias``) and
their config rules."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.clamped_swiglu import clamped_swiglu_packed
from moetrain.model.moe.experts import GroupedExperts
from moetrain.model.moe.router import Router
from tests.helpers.configs import tiny_config

CLAMPED = {"moe.activation": "clamped_swiglu", "moe.swiglu_alpha": 1.702, "moe.swiglu_limit": 0.7}


def test_clamped_swiglu_is_gpt_oss_formula_where_the_clamps_bind() -> None:
    h = torch.linspace(-3, 3, 2 * 50, dtype=torch.float64).view(1, -1).repeat(3, 1)
    h = h[:, torch.randperm(100, generator=torch.Generator().manual_seed(0))].requires_grad_()
    gate, up = h[:, :50], h[:, 50:]
    g = torch.where(gate > 0.7, 0.7, gate)
    u = torch.where(up > 0.7, 0.7, torch.where(up < -0.7, -0.7, up))
    want = (u + 1) * g * torch.sigmoid(1.702 * g)
    got = clamped_swiglu_packed(h, None, 1.702, 0.7)
    torch.testing.assert_close(got, want)
    assert (gate > 0.7).any() and (up.abs() > 0.7).any()  # both clamps bind
    (grad,) = torch.autograd.grad(got.sum(), h)
    assert torch.all(grad[:, :50][gate > 0.7] == 0) and torch.all(grad[:, 50:][up.abs() > 0.7] == 0)
    w = torch.rand(3, dtype=torch.float64)
    torch.testing.assert_close(clamped_swiglu_packed(h, w, 1.702, 0.7), want * w[:, None])


def _clamped_composition(h, w, alpha: float, limit: float) -> torch.Tensor:
    """The clamped SwiGLU as autograd's composition of torch ops (the gradient reference)."""
    a, b = h.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    out = (b.clamp(-limit, limit) + 1) * (a * torch.sigmoid(alpha * a))
    return out if w is None else (out * w.unsqueeze(-1)).to(h.dtype)


@pytest.mark.parametrize("weighted", [False, True])
def test_clamped_swiglu_gradient_is_autograds(weighted: bool) -> None:
    torch.manual_seed(0)
    h = (torch.randn(5, 7, 2 * 6, dtype=torch.float64) * 1.5).requires_grad_()
    w = torch.rand(5, 7, dtype=torch.float64, requires_grad=True) if weighted else None
    torch.autograd.gradcheck(lambda h, w: clamped_swiglu_packed(h, w, 1.702, 0.7), (h, w))
    grad_out = torch.randn(5, 7, 6, dtype=torch.float64)
    inputs = (h, w) if weighted else (h,)
    got = torch.autograd.grad(clamped_swiglu_packed(h, w, 1.702, 0.7), inputs, grad_out)
    want = torch.autograd.grad(_clamped_composition(h, w, 1.702, 0.7), inputs, grad_out)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)


def test_clamped_swiglu_bf16_with_fp32_weights_computes_in_fp32() -> None:
    torch.manual_seed(0)
    h32 = torch.randn(64, 2 * 16) * 1.5
    h = h32.bfloat16().requires_grad_()
    w = torch.rand(64, requires_grad=True)
    out = clamped_swiglu_packed(h, w, 1.702, 0.7)
    assert out.dtype == torch.bfloat16
    want = _clamped_composition(h.detach().float(), w.detach(), 1.702, 0.7)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    out.float().sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def _experts(grouped: bool, recompute: bool = False) -> GroupedExperts:
    torch.manual_seed(0)
    ex = GroupedExperts(
        4,
        8,
        6,
        grouped,
        recompute_act=recompute,
        biases=True,
        activation="clamped_swiglu",
        alpha=1.702,
        limit=0.5,
    )
    ex.reset_parameters(0.5, 0.5)
    with torch.no_grad():
        ex.w13_bias.uniform_(-1, 1)
        ex.w2_bias.uniform_(-1, 1)
    return ex


def _reference(ex: GroupedExperts, x, counts, weights) -> torch.Tensor:
    """Expert by expert: ``(act(x W13 + b13) W2 + b2) * w``, the routing weight scaling the
    whole output (gpt-oss's order)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        h = x[rows] @ ex.w13[e] + ex.w13_bias[e]
        a, b = h.chunk(2, -1)
        a = a.clamp(max=0.5)
        act = (b.clamp(-0.5, 0.5) + 1) * a * torch.sigmoid(1.702 * a)
        outs.append((act @ ex.w2[e] + ex.w2_bias[e]) * weights[rows, None])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(("grouped", "recompute"), [(True, False), (False, False), (True, True)])
def test_expert_biases_and_clamped_act_match_a_per_expert_reference(grouped, recompute) -> None:
    ex = _experts(grouped, recompute)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = torch.rand(10, generator=torch.Generator().manual_seed(2), requires_grad=True)
    got, ref = ex(x, counts, w), _reference(ex, x, counts, w)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    params = [x, w, ex.w13, ex.w2, ex.w13_bias, ex.w2_bias]
    grad = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad(got, params, grad), torch.autograd.grad(ref, params, grad), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert ex.param_names == ("w13", "w2", "w13_bias", "w2_bias")
    with pytest.raises(ValueError, match="own weights"):  # shadow experts' stacked weights
        ex(x, counts, w, ex.w13, ex.w2)


def test_router_bias_is_part_of_the_logits() -> None:
    cfg = tiny_config({"moe.router_bias": True, "moe.topk_before_score": True}).moe
    torch.manual_seed(0)
    router = Router(cfg, 32)
    with torch.no_grad():
        router.gate.weight.normal_()
        router.gate.bias.copy_(torch.tensor([0.0, 3.0, -3.0, 1.0]))
    x = torch.randn(7, 32)
    out = router(x)
    logits = x @ router.gate.weight.t() + router.gate.bias
    top = logits.topk(2, dim=-1)
    torch.testing.assert_close(out.ids_TK, top.indices)
    torch.testing.assert_close(out.weights_TK, top.values.softmax(-1))


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"moe.activation": "clamped_swiglu"}, "moe.swiglu_alpha"),
        ({"moe.swiglu_limit": 7.0}, "moe.swiglu_limit"),
        ({**CLAMPED, "moe.swiglu_limit": -1.0}, "moe.swiglu_limit"),
    ],
)
def test_activation_rules_are_refused_by_key(extra, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(extra)


def test_shadow_experts_with_expert_biases_are_refused_by_key() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.shadow_experts"):
        tiny_config({"moe.expert_biases": True, "parallel.shadow_experts": 1})
