"""MoE health metrics on a router with a known routing, and the dead-expert warning."""

import math
from collections.abc import Callable

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.moe.layer import MoELayer
from moetrain.model.moe.router import Router
from moetrain.monitor.moe_health import (
    DeadExpertWatch,
    LayerStats,
    load_lists,
    load_matrix,
    moe_health_metrics,
)


def _known_router(capacity_factor: float) -> tuple[Callable, Router, torch.Tensor]:
    """An MoE layer (-> its MoEOutput), its router and tokens: E=4, top-1, gate = 10 * I,
    one-hot tokens -> token t goes to expert target[t]."""
    cfg = MoEConfig(num_experts=4, top_k=1, expert_hidden=8, capacity_factor=capacity_factor)
    layer = MoELayer(cfg, d_model=4)
    router = layer.router
    with torch.no_grad():
        router.gate.weight.copy_(10 * torch.eye(4))
        router.expert_bias.copy_(torch.tensor([0.1, -0.1, 0.0, 0.05]))
    target = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2])  # loads 5, 2, 1, 0
    x = torch.nn.functional.one_hot(target, 4).float()
    return lambda x_TD: layer(x_TD.unsqueeze(0))[1], router, x


def test_known_routing_imbalance_cv_dropped():
    # capacity = ceil(1.0 * T=8 * K=1 / E=4) = 2 -> expert 0 keeps 2 of 5: 3 dropped of 8.
    moe, router, x = _known_router(capacity_factor=1.0)
    out = moe(x)
    assert out.tokens_per_expert_E.tolist() == [5, 2, 1, 0]
    stats = LayerStats.from_moe_output(out, expert_bias=router.expert_bias)
    m = moe_health_metrics({3: stats}, aux_coef=0.01, z_coef=0.001, ep_size=2)

    assert m["moe/layer3/tokens"] == 8
    assert m["moe/layer3/imbalance_max_over_mean"] == pytest.approx(5 / 2)
    assert m["moe/layer3/imbalance_min_over_mean"] == 0
    # population std of [5,2,1,0] = sqrt((9+0+1+4)/4) = sqrt(3.5); mean 2
    assert m["moe/layer3/cv"] == pytest.approx(math.sqrt(3.5) / 2)
    assert m["moe/layer3/dropped_frac"] == pytest.approx(3 / 8)
    shares = [5 / 8, 2 / 8, 1 / 8]
    h = -sum(p * math.log(p) for p in shares)
    assert m["moe/layer3/load_entropy_norm"] == pytest.approx(h / math.log(4))
    assert m["moe/layer3/dead_experts"] == 1
    # EP rank 0 holds experts 0-1 (5 + 2 copies), rank 1 experts 2-3 (1 + 0): 7 / mean 4
    assert m["moe/layer3/ep_max_over_mean"] == pytest.approx(7 / 4)
    assert m["moe/ep_max_over_mean"] == pytest.approx(7 / 4)
    assert m["moe/layer3/entropy"] == pytest.approx(out.entropy.item())
    assert m["moe/layer3/aux_loss"] == pytest.approx(out.aux_loss.item())
    assert m["moe/layer3/aux_loss_scaled"] == pytest.approx(0.01 * out.aux_loss.item())
    assert m["moe/layer3/z_loss_scaled"] == pytest.approx(0.001 * out.z_loss.item())
    assert m["moe/layer3/bias_min"] == pytest.approx(-0.1)
    assert m["moe/layer3/bias_max"] == pytest.approx(0.1)
    assert m["moe/bias_absmax"] == pytest.approx(0.1)
    assert m["moe/dropped_frac"] == pytest.approx(3 / 8)
    assert all(isinstance(v, float) for v in m.values())


def test_dropless_router_and_global_summaries():
    moe, _, x = _known_router(capacity_factor=0.0)
    out = moe(x)
    balanced = LayerStats(tokens_per_expert=[4, 4, 4, 4], dropped=0, aux_loss=1.0, z_loss=2.0)
    m = moe_health_metrics([LayerStats.from_moe_output(out), balanced], aux_coef=0.5, z_coef=0.1)
    assert m["moe/layer0/dropped_frac"] == 0
    assert m["moe/layer1/imbalance_max_over_mean"] == 1
    assert m["moe/layer1/cv"] == 0
    assert m["moe/layer1/load_entropy_norm"] == pytest.approx(1.0)
    assert m["moe/imbalance_max_over_mean"] == pytest.approx(2.5)  # worst layer
    assert m["moe/cv_mean"] == pytest.approx((math.sqrt(3.5) / 2 + 0) / 2)
    assert m["moe/dead_experts"] == 1
    assert not any("ep_max_over_mean" in k for k in m)  # one process: no EP ranks
    assert m["moe/aux_loss"] == pytest.approx(out.aux_loss.item() + 1.0)
    assert m["moe/aux_loss_scaled"] == pytest.approx(0.5 * (out.aux_loss.item() + 1.0))
    assert m["moe/z_loss_scaled"] == pytest.approx(0.1 * (out.z_loss.item() + 2.0))
    assert load_lists({2: balanced}) == {"moe/layer2/tokens_per_expert": [4, 4, 4, 4]}
    assert load_matrix([balanced, balanced]).shape == (2, 4)


def test_dead_expert_watch_warns_once_until_recovery():
    msgs: list[str] = []
    watch = DeadExpertWatch(rel_threshold=0.05, patience=3, printer=msgs.append)
    dead3 = [100, 100, 100, 1]  # expert 3: 1 < 0.05 * 75.25
    ok = [100, 100, 100, 100]
    assert watch.update(1, {0: dead3, 1: ok}) == []
    assert watch.update(2, {0: dead3, 1: ok}) == []
    assert watch.update(3, {0: dead3, 1: ok}) == [(0, 3)]
    assert len(msgs) == 1 and "layer 0 expert 3" in msgs[0] and "3 steps" in msgs[0]
    assert watch.update(4, {0: dead3, 1: ok}) == []  # no repeat while still dead
    assert len(msgs) == 1 and watch.warned == {(0, 3)}
    watch.update(5, {0: ok, 1: ok})
    assert len(msgs) == 2 and "recovered" in msgs[1] and watch.warned == set()
    for step in (6, 7):
        assert watch.update(step, {0: dead3, 1: ok}) == []
    assert watch.update(8, {0: dead3, 1: ok}) == [(0, 3)]  # re-armed after recovery
    assert len(msgs) == 3


def test_dead_expert_watch_counts_steps_not_calls(capsys):
    watch = DeadExpertWatch(rel_threshold=0.01, patience=15)  # default console printer
    load = [[10, 10, 0, 10]]
    assert watch.update(10, load) == []
    assert watch.update(20, load) == []  # 11 steps < 15
    assert watch.update(30, load) == [(0, 2)]  # 21 steps
    assert "expert 2" in capsys.readouterr().out
    assert watch.update(40, [[0, 0, 0, 0]]) == []  # empty layer: not judged
