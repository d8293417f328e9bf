"""Zero experts (``moe.zero_experts``, LongCat-Flash's zero-computation experts) against a
written-out reference: a loop over tokens and the choices each token made among the routed and
the zero experts, values and gradients; capacity, the balancing loss, the bias update and the
zero-expert count written out by hand too."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.config.checks import ConfigError
from moetrain.model.moe.experts import unpack_w13
from moetrain.model.moe.layer import MoELayer
from tests.helpers.configs import tiny_config

D = 8


def build(seed: int = 0, **kw) -> MoELayer:
    torch.manual_seed(seed)
    cfg = tiny_config({f"moe.{k}": v for k, v in kw.items()}, moe__expert_hidden=16)
    layer = MoELayer(cfg.moe, D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        layer.router.expert_bias.normal_(0, 0.05)
    return layer


def reference(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Loop over tokens: ``(y_TD, aux_loss, dropped, zero picks)``. A zero expert returns the
    token itself; capacity counts the routed experts' copies only; the balancing loss pools the
    zero experts into one group (their mean selection fraction)."""
    cfg = layer.cfg
    e, z, k = cfg.num_experts, cfg.zero_experts, cfg.top_k
    wg, bias, ex = layer.router.gate.weight, layer.router.expert_bias, layer.experts
    t_count = x_TD.shape[0]
    choices, probs = [], []  # (token, choice, weight)
    for t in range(t_count):
        p = torch.softmax(wg @ x_TD[t], 0)
        probs.append(p)
        order = sorted(range(e + z), key=lambda i: -(p[i] + bias[i]).item())[:k]
        w = torch.stack([p[i] for i in order])
        if cfg.renormalize:
            w = w / w.sum()
        choices += [(t, i, w[j] * cfg.route_scale) for j, i in enumerate(order)]
    routed = [c for c in choices if c[1] < e]
    kept = routed
    if cfg.capacity_factor > 0:
        cap = math.ceil(cfg.capacity_factor * t_count * k / e)
        kept = []
        for i in range(e):
            mine = sorted((c for c in routed if c[1] == i), key=lambda c: -c[2].item())
            kept += mine[:cap]
    ys = [torch.zeros(D) for _ in range(t_count)]
    for t, i, w in kept:
        w1, w3 = unpack_w13(ex.w13[i])
        ys[t] = ys[t] + w * ((F.silu(x_TD[t] @ w1) * (x_TD[t] @ w3)) @ ex.w2[i])
    for t, i, w in choices:
        if i >= e:
            ys[t] = ys[t] + w * x_TD[t]
    frac = torch.zeros(e + z)
    for _, i, _ in choices:
        frac[i] += 1 / (t_count * k)
    frac[e:] = frac[e:].mean()
    mean_p = torch.stack(probs).mean(0)
    aux = (e + z) * sum(frac[i] * mean_p[i] for i in range(e + z))
    return torch.stack(ys), aux, len(routed) - len(kept), len(choices) - len(routed)


SETTINGS = [
    dict(num_experts=4, zero_experts=2, top_k=3, renormalize=False, route_scale=6.0),
    dict(num_experts=4, zero_experts=4, top_k=2, capacity_factor=0.75),
    dict(num_experts=3, zero_experts=2, top_k=4, renormalize=False, aux_loss_scope="micro_batch"),
]


@pytest.mark.parametrize("kw", SETTINGS)
def test_values_and_gradients_match_the_written_out_reference(kw: dict) -> None:
    layer = build(**kw)
    x = torch.randn(2, 6, D)
    x_ours = x.clone().requires_grad_(True)
    y, stats = layer(x_ours)
    x_ref = x.reshape(-1, D).clone().requires_grad_(True)
    y_ref, aux_ref, dropped_ref, zero_ref = reference(layer, x_ref)
    assert zero_ref > 0, "the setting must route some copies to zero experts"
    torch.testing.assert_close(y.reshape(-1, D), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.aux_loss, aux_ref, rtol=1e-5, atol=1e-6)
    assert int(stats.dropped) == dropped_ref
    assert int(stats.zero_copies) == zero_ref
    assert stats.tokens_per_expert_E.shape == (kw["num_experts"],)
    assert int(stats.tokens_per_expert_E.sum()) + zero_ref == x.shape[0] * x.shape[1] * kw["top_k"]

    probe = torch.randn_like(y)
    params = [layer.router.gate.weight, layer.experts.w13, layer.experts.w2]
    ours = torch.autograd.grad((y * probe).sum() + stats.aux_loss, [x_ours, *params])
    refs = torch.autograd.grad((y_ref * probe.reshape(-1, D)).sum() + aux_ref, [x_ref, *params])
    for name, a, b in zip(["x", "gate", "w13", "w2"], ours, refs, strict=True):
        scale = float(b.abs().max())  # (sums of large products: an absolute tolerance by size)
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_the_tolerance_catches_a_missing_identity_output() -> None:
    """Negative control: the reference without the zero experts' identity term is far outside
    the tolerance the test above uses."""
    layer = build(**SETTINGS[0])
    x = torch.randn(12, D)
    with torch.no_grad():
        y, _ = layer(x.view(2, 6, D))
        r = layer.router(x)
        zero_w = r.weights_TK.masked_fill(r.ids_TK < layer.cfg.num_experts, 0).sum(-1, True)
        y_ref, *_ = reference(layer, x)
    torch.testing.assert_close(y.reshape(-1, D), y_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(y.reshape(-1, D), y_ref - zero_w * x, rtol=1e-5, atol=1e-5)


def test_zero_copies_take_no_capacity_and_no_dispatch() -> None:
    """Every token picks only zero experts when their selection bias is huge: nothing is sent
    to an expert, nothing dropped, and the layer returns the weighted input."""
    layer = build(num_experts=4, zero_experts=2, top_k=2, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.expert_bias[4:] = 100.0
    x = torch.randn(1, 8, D)
    sent = []
    dispatch = layer.dispatcher.dispatch
    layer.dispatcher.dispatch = lambda *a, **kw: sent.append(dispatch(*a, **kw)) or sent[-1]
    y, stats = layer(x)
    assert sent[0].x_ND.shape[0] == 0 and int(sent[0].counts_L.sum()) == 0
    assert int(stats.dropped) == 0 and int(stats.zero_copies) == 16
    r = layer.router(x.view(-1, D))
    torch.testing.assert_close(y.view(-1, D), x.view(-1, D) * r.weights_TK.sum(-1, True))


def test_bias_update_moves_the_routed_experts_only() -> None:
    layer = build(num_experts=4, zero_experts=2, top_k=2, bias_update_rate=0.1)
    before = layer.router.expert_bias.clone()
    layer.router.update_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]))
    step = layer.router.expert_bias - before
    torch.testing.assert_close(step, torch.tensor([-0.1, 0.1, 0.0, 0.0, 0.0, 0.0]))
    assert layer.router.gate.weight.shape == (6, D) and before.shape == (6,)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("router_type", "sparsemixer"),
        ("n_group", 2),
        ("topk_before_score", True),
        ("expert_scale", True),
        ("latent_dim", 4),
    ],
)
def test_refused_with_what_it_cannot_hold(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"moe.{key}"):
        tiny_config({"moe.zero_experts": 2, "moe.num_experts": 4, f"moe.{key}": value})


def test_top_k_may_exceed_the_routed_experts_but_not_all_choices() -> None:
    tiny_config({"moe.num_experts": 2, "moe.zero_experts": 2, "moe.top_k": 4})
    with pytest.raises(ConfigError, match="moe.top_k"):
        tiny_config({"moe.num_experts": 2, "moe.zero_experts": 2, "moe.top_k": 5})


def test_zero_expert_share_lands_in_the_metrics() -> None:
    """metrics.jsonl's record of a step: each layer's share and their mean, only with zero
    experts."""
    from moetrain.monitor.records import step_metrics

    layer = dict(dropped=0.0, entropy=1.0, aux_loss=1.0, z_loss=0.1, expert_bias=[0.0] * 6)
    layer |= dict(tokens_per_expert=[3.0, 1.0, 2.0, 2.0], dropped_frac=0.0)
    rec = {"step": 1, "loss": 1.0, "ce_loss": 1.0, "lr": 1e-3}
    rec["moe_layers"] = {
        0: {**layer, "zero_expert_share": 0.25},
        1: {**layer, "zero_expert_share": 0.5},
    }
    cfg = tiny_config({"moe.zero_experts": 2, "moe.num_experts": 4})
    out = step_metrics(rec, cfg, None, 1)
    assert out["moe/layer0/zero_expert_share"] == 0.25
    assert out["moe/layer1/zero_expert_share"] == 0.5
    assert out["moe/zero_expert_share"] == 0.375
    plain = step_metrics(rec, tiny_config(), None, 1)
    assert not [k for k in plain if "zero_expert" in k]
