"""The MoE block against the simplest possible reference: a Python loop over tokens and the
experts each token selected, with routing, capacity and the aux loss written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.moe.dispatch import permute, unpermute
from moetrain.model.moe.experts import GroupedExperts, unpack_w13
from moetrain.model.moe.layer import MoELayer
from tests.helpers.configs import tiny_config

D = 8


def reference(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Loop over tokens: returns (y_TD, aux_loss, dropped)."""
    cfg = layer.cfg
    e, k = cfg.num_experts, cfg.top_k
    wg, bias = layer.router.gate.weight, layer.router.expert_bias
    ex = layer.experts
    t_count = x_TD.shape[0]
    choices = []  # (token, expert, weight)
    probs = []
    for t in range(t_count):
        logits = wg @ x_TD[t]
        p = torch.softmax(logits, 0)
        probs.append(p)
        order = sorted(range(e), key=lambda i: -(p[i] + bias[i]).item())[:k]
        w = torch.stack([p[i] for i in order])
        if cfg.renormalize:
            w = w / w.sum()
        choices += [(t, i, w[j] * cfg.route_scale) for j, i in enumerate(order)]
    kept = choices
    if cfg.capacity_factor > 0:
        cap = math.ceil(cfg.capacity_factor * t_count * k / e)
        kept = []
        for i in range(e):
            mine = [c for c in choices if c[1] == i]
            mine.sort(key=lambda c: -c[2].item())  # stable: earlier tokens win ties
            kept += mine[:cap]
    ys = [torch.zeros(D) for _ in range(t_count)]
    for t, i, w in kept:
        w1, w3 = unpack_w13(ex.w13[i])
        h = F.silu(x_TD[t] @ w1) * (x_TD[t] @ w3)
        ys[t] = ys[t] + w * (h @ ex.w2[i])
    y = torch.stack(ys)
    if layer.shared_expert is not None:
        s = layer.shared_expert
        for t in range(t_count):
            out = s.w2.weight @ (F.silu(s.w1.weight @ x_TD[t]) * (s.w3.weight @ x_TD[t]))
            if layer.shared_gate is not None:
                out = torch.sigmoid(layer.shared_gate.weight[0] @ x_TD[t]) * out
            y[t] = y[t] + out
    counts = torch.zeros(e)
    for _, i, _ in choices:
        counts[i] += 1
    aux = e * sum(counts[i] / (t_count * k) * torch.stack(probs)[:, i].mean() for i in range(e))
    return y, aux, len(choices) - len(kept)


SETTINGS = [
    dict(num_experts=4, top_k=1),
    dict(num_experts=4, top_k=2, num_shared_experts=1, shared_expert_gate=True, recompute_act=True),
    dict(num_experts=8, top_k=2, capacity_factor=1.0, recompute_act=True),
    dict(num_experts=6, top_k=3, capacity_factor=0.5, num_shared_experts=2, renormalize=False),
    dict(num_experts=5, top_k=2, route_scale=2.5, shared_expert_hidden=12, num_shared_experts=1),
]


def build(seed: int = 0, bias: list[float] | None = None, **kw) -> MoELayer:
    torch.manual_seed(seed)
    cfg = tiny_config({f"moe.{k}": v for k, v in kw.items()}, moe__expert_hidden=16)
    layer = MoELayer(cfg.moe, D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        if bias is not None:
            layer.router.expert_bias.copy_(torch.tensor(bias))
    return layer


def check_against_reference(layer: MoELayer, t_count: int = 24) -> None:
    x = torch.randn(2, t_count // 2, D, requires_grad=True)
    r = torch.randn(2, t_count // 2, D)
    y, stats = layer(x)
    ((y * r).sum() + stats.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    gx = x.grad.clone()
    layer.zero_grad()
    x.grad = None

    y_ref, aux_ref, dropped_ref = reference(layer, x.view(-1, D))
    ((y_ref.view_as(r) * r).sum() + aux_ref).backward()
    torch.testing.assert_close(y, y_ref.view_as(y), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.aux_loss, aux_ref, atol=1e-6, rtol=1e-6)
    assert int(stats.dropped) == dropped_ref
    assert stats.dropped_fraction.item() == pytest.approx(dropped_ref / (t_count * layer.cfg.top_k))
    torch.testing.assert_close(x.grad, gx, atol=1e-5, rtol=1e-5)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_moe_block_matches_token_loop(setting: dict, grouped_mm: bool) -> None:
    check_against_reference(build(grouped_mm=grouped_mm, **setting))


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_experts_with_zero_tokens(grouped_mm: bool) -> None:
    # the bias pushes every token to experts 0 and 1; experts 2..7 get nothing
    layer = build(num_experts=8, top_k=2, grouped_mm=grouped_mm, bias=[50, 50] + [0] * 6)
    _, stats = layer(torch.randn(1, 10, D))
    assert stats.tokens_per_expert_E.tolist() == [10, 10] + [0] * 6
    check_against_reference(layer, t_count=10)
    assert torch.all(layer.experts.w13.grad[2:] == 0)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_no_tokens_at_all(grouped_mm: bool) -> None:
    experts = GroupedExperts(4, D, 16, grouped_mm)
    torch.nn.init.normal_(experts.w13)
    y = experts(torch.zeros(0, D), torch.zeros(4, dtype=torch.int64))
    assert y.shape == (0, D)
    y.sum().backward()
    assert experts.w13.grad is not None and torch.all(experts.w13.grad == 0)
    layer = build(num_experts=4, top_k=2, grouped_mm=grouped_mm, capacity_factor=1.0)
    out, stats = layer(torch.zeros(2, 0, D))
    assert out.shape == (2, 0, D) and torch.isfinite(stats.aux_loss) and int(stats.dropped) == 0


def test_grouped_mm_equals_loop_on_uneven_groups() -> None:
    torch.manual_seed(1)
    a, b = GroupedExperts(5, D, 16, True), GroupedExperts(5, D, 16, False)
    for p in a.parameters():
        torch.nn.init.normal_(p)
    b.load_state_dict(a.state_dict())
    counts = torch.tensor([3, 0, 7, 1, 0])
    x = torch.randn(11, D)
    ya, yb = a(x, counts), b(x, counts)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    ya.sum().backward()  # stride-0 incoming gradient: grouped_mm's CPU backward needs a copy
    yb.sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-5, rtol=1e-5)


def test_permute_groups_by_expert_and_unpermute_inverts() -> None:
    x = torch.arange(1.0, 5.0).repeat_interleave(3).view(4, 3)  # token t is all (t + 1)'s
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    keep = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    w = torch.tensor([[0.5, 0.25], [1.0, 7.0], [0.5, 0.5], [1.0, 1.0]])
    x_ND, w_N, counts, ctx = permute(x, ids, keep, w, num_experts=3)
    assert counts.tolist() == [3, 1, 3]
    # expert 0: tokens 0, 1, 3; expert 1: token 2 (token 1's copy is dropped); expert 2: 0, 2, 3
    assert x_ND[:, 0].tolist() == [1, 2, 4, 3, 1, 3, 4]
    assert w_N.tolist() == [0.25, 1.0, 1.0, 0.5, 0.5, 0.5, 1.0]
    y = unpermute(x_ND * w_N.unsqueeze(1), ctx)
    torch.testing.assert_close(y[:, 0], torch.tensor([0.75, 2.0, 3.0, 8.0]))
    # dropless: the same sums through the inverse permutation
    x_ND, w_N, counts, ctx = permute(x, ids, torch.ones_like(keep), w, num_experts=3)
    y = unpermute(x_ND * w_N.unsqueeze(1), ctx)
    torch.testing.assert_close(y[:, 0], torch.tensor([0.75, 16.0, 3.0, 8.0]))


def test_stats_are_detached_and_consistent() -> None:
    layer = build(num_experts=4, top_k=2, capacity_factor=0.5)
    _, s = layer(torch.randn(2, 8, D))
    assert not s.tokens_per_expert_E.requires_grad and not s.entropy.requires_grad
    assert s.tokens_per_expert_E.sum().item() == 32
    assert s.load_max_over_mean.item() == pytest.approx(
        (s.tokens_per_expert_E.max() / s.tokens_per_expert_E.mean()).item()
    )
    assert s.aux_loss.requires_grad and s.z_loss.requires_grad
    assert int(s.dropped) > 0  # capacity ceil(0.5 * 16 * 2 / 4) = 4 per expert < 32 / 4


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "save"])
@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_experts_saved_tensors_and_gradients(
    grouped_mm: bool, recompute: bool, weighted: bool
) -> None:
    """Per routed copy the experts keep x (D), the packed gate|up output (2F) and the routing
    weight (1) for backward, plus the SwiGLU activation (F) unless it is recomputed; gradients
    (the weights' too) match plain autograd."""
    torch.manual_seed(2)
    experts = GroupedExperts(3, D, 16, grouped_mm, recompute_act=recompute)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    counts = torch.tensor([5, 0, 4])
    x = torch.randn(9, D, requires_grad=True)
    w = torch.rand(9, requires_grad=True) if weighted else None
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() > 3:  # skip the offsets
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = experts(x, counts, w)
    weights = sum(p.numel() for p in experts.parameters()) * 4
    per_copy = (2 * 16 if recompute else 3 * 16) + weighted
    assert sum(storages.values()) == x.numel() * 4 + 9 * per_copy * 4 + weights

    grad = torch.randn_like(y)
    y.backward(grad)
    w1, w3 = (w.detach().requires_grad_(True) for w in unpack_w13(experts.w13))
    w2 = experts.w2.detach().requires_grad_(True)
    x_ref = x.detach().requires_grad_(True)
    w_ref = (w if weighted else torch.ones(9)).detach().requires_grad_(True)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe, we = x_ref[start : start + n], w_ref[start : start + n, None]
        outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e] * we)
        start += n
    torch.cat(outs).backward(grad)
    if weighted:
        torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(experts.w2.grad, w2.grad, atol=1e-4, rtol=1e-5)
    w13_ref = torch.cat([w1.grad, w3.grad], dim=-1)
    torch.testing.assert_close(experts.w13.grad, w13_ref, atol=1e-4, rtol=1e-5)
