"""Llama 4's routing rule: top-k on the router logits, each chosen expert's weight the sigmoid of
its logit (``moe.score_func: sigmoid`` with ``moe.topk_before_score``), applied to the expert's
input (``moe.score_on_input``) and the outputs summed with weight 1, beside an ungated shared
expert: the MoE block against a hand-written loop over tokens and their experts, values and
gradients, and the config and router rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.moe.experts import unpack_w13
from moetrain.model.moe.layer import MoELayer
from tests.helpers.configs import tiny_config

D = 8
LLAMA4 = dict(
    score_func="sigmoid",
    topk_before_score=True,
    renormalize=False,
    score_on_input=True,
    num_shared_experts=1,
)


def reference(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token: the top-k logits, ``y = shared(x) + sum_e expert_e(sigmoid(l_e) * x)``
    (an expert's biases, where it has them, unscaled); capacity drops the lowest weights."""
    cfg, ex = layer.cfg, layer.experts
    choices = []  # (token, expert, weight)
    for t in range(x_TD.shape[0]):
        logits = layer.router.gate.weight @ x_TD[t]
        order = sorted(range(cfg.num_experts), key=lambda i: -logits[i].item())[: cfg.top_k]
        w = torch.stack([torch.sigmoid(logits[i]) for i in order])
        if cfg.renormalize:
            w = w / w.sum()
        choices += [(t, i, w[j]) for j, i in enumerate(order)]
    if cfg.capacity_factor > 0:
        cap = math.ceil(cfg.capacity_factor * x_TD.shape[0] * cfg.top_k / cfg.num_experts)
        choices = [
            c
            for i in range(cfg.num_experts)
            for c in sorted((c for c in choices if c[1] == i), key=lambda c: -c[2].item())[:cap]
        ]
    ys = [torch.zeros(D) for _ in range(x_TD.shape[0])]
    for t, i, w in choices:
        xin = w * x_TD[t]
        w1, w3 = unpack_w13(ex.w13[i])
        g, u = xin @ w1, xin @ w3
        if ex.w13_bias is not None:
            b1, b3 = ex.w13_bias[i].chunk(2)
            g, u = g + b1, u + b3
        out = (F.silu(g) * u) @ ex.w2[i]
        ys[t] = ys[t] + (out if ex.w2_bias is None else out + ex.w2_bias[i])
    s = layer.shared_expert
    shared = [s.w2.weight @ (F.silu(s.w1.weight @ x) * (s.w3.weight @ x)) for x in x_TD]
    return torch.stack([y + z for y, z in zip(ys, shared, strict=True)])


def build(**kw) -> MoELayer:
    torch.manual_seed(0)
    cfg = tiny_config({f"moe.{k}": v for k, v in {**LLAMA4, **kw}.items()}, moe__expert_hidden=16)
    layer = MoELayer(cfg.moe, D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


SETTINGS = [  # (the experts' two paths, grouped GEMM and the loop, on the first)
    dict(num_experts=4, top_k=1, grouped_mm=True),  # Scout's and Maverick's top-1
    dict(num_experts=4, top_k=1, grouped_mm=False),
    dict(num_experts=6, top_k=2, recompute_act=True),
    dict(num_experts=4, top_k=2, renormalize=True, shared_expert_overlap=False),
    dict(num_experts=8, top_k=2, capacity_factor=1.0),
    dict(num_experts=4, top_k=2, expert_biases=True, grouped_mm=False),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_input_scored_block_matches_the_token_loop(setting: dict) -> None:
    layer = build(**setting)
    x = torch.randn(2, 12, D, requires_grad=True)
    r = torch.randn(2, 12, D)
    y, _ = layer(x)
    (y * r).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    gx = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    y_ref = reference(layer, x.view(-1, D)).view_as(y)
    (y_ref * r).sum().backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-5)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-5, msg=n)
    assert layer.router.gate.weight.grad.abs().max() > 1e-3  # the router learns through w
    # the weight on the input is not the weight on the output: the rule binds
    with torch.no_grad():
        layer.experts.score_on_input = False
        assert (layer(x)[0] - y).abs().max() > 1e-3


def test_selection_is_on_the_logits_and_weights_their_sigmoids() -> None:
    """Logits 20 and 30 both have sigmoid 1.0 in fp32: top-1 on the logits picks 30's expert;
    the weights are the chosen logits' sigmoids, renormalised only with moe.renormalize."""
    from moetrain.config import MoEConfig
    from moetrain.model.moe.router import Router

    for renormalize in (False, True):
        cfg = MoEConfig(num_experts=4, top_k=2, **{**LLAMA4, "renormalize": renormalize})
        router = Router(cfg, d_model=4).eval()
        with torch.no_grad():
            router.gate.weight.copy_(torch.eye(4))
        out = router(torch.tensor([[20.0, 30.0, 0.0, -1.0], [0.0, math.log(3.0), -2.0, 1.0]]))
        assert out.ids_TK.tolist() == [[1, 0], [1, 3]]
        want = torch.tensor([[1.0, 1.0], [0.75, 1 / (1 + math.exp(-1.0))]])
        if renormalize:
            want = want / want.sum(-1, keepdim=True)
        torch.testing.assert_close(out.weights_TK, want)


def test_bf16_rows_take_the_weight_in_their_dtype() -> None:
    """Under bf16 the weight is rounded to bf16 before it scales the input (transformers'
    Llama 4 casts the router scores to the hidden states' dtype)."""
    from moetrain.model.moe.experts import GroupedExperts

    torch.manual_seed(0)
    ex = GroupedExperts(2, D, 16, grouped_mm=False, score_on_input=True)
    torch.nn.init.normal_(ex.w13)
    torch.nn.init.normal_(ex.w2)
    ex = ex.bfloat16()
    x = torch.randn(5, D).bfloat16()
    w = torch.rand(5)
    counts = torch.tensor([3, 2])
    plain = GroupedExperts(2, D, 16, grouped_mm=False).bfloat16()
    plain.load_state_dict(ex.state_dict())
    want = plain(x * w.bfloat16()[:, None], counts)
    torch.testing.assert_close(ex(x, counts, w), want, atol=0, rtol=0)
