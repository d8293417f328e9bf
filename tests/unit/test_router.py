"""Router and balancing losses against values computed by hand on tiny inputs.

The gate is the identity (D = E), so the router logits are the inputs themselves.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.moe.router import Router, capacity_keep

LN2, LN4 = math.log(2.0), math.log(4.0)
# logits [0, 0, ln2, ln4] -> exp [1, 1, 2, 4] / 8 -> probs [1/8, 1/8, 1/4, 1/2]
ROW_A = [0.0, 0.0, LN2, LN4]
# logits [ln4, ln2, 0, 0] -> probs [1/2, 1/4, 1/8, 1/8]
ROW_B = [LN4, LN2, 0.0, 0.0]


def make_router(**kw) -> Router:
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, **kw})
    r = Router(cfg, d_model=cfg.num_experts)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(cfg.num_experts))
    return r.eval()


def close(a: torch.Tensor, b) -> None:
    torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), atol=1e-6, rtol=1e-6)


def test_softmax_topk_renormalised() -> None:
    out = make_router()(torch.tensor([ROW_A, ROW_B]))
    assert out.ids_TK.tolist() == [[3, 2], [0, 1]]
    close(out.weights_TK, [[2 / 3, 1 / 3], [2 / 3, 1 / 3]])
    assert out.weights_TK.dtype == torch.float32 and out.ids_TK.dtype == torch.int64
    assert out.keep_TK.all() and int(out.dropped) == 0


def test_softmax_topk_without_renormalisation_and_route_scale() -> None:
    out = make_router(renormalize=False, route_scale=2.0)(torch.tensor([ROW_A]))
    close(out.weights_TK, [[2 * 0.5, 2 * 0.25]])


def test_topk_then_softmax() -> None:
    out = make_router(topk_before_score=True, renormalize=False)(torch.tensor([ROW_A]))
    assert out.ids_TK.tolist() == [[3, 2]]
    close(out.weights_TK, [[2 / 3, 1 / 3]])  # softmax over [ln4, ln2] only


def test_sigmoid_scores() -> None:
    x = torch.tensor([[0.0, math.log(3.0), -math.log(3.0), math.log(9.0)]])
    # sigmoid -> [1/2, 3/4, 1/4, 9/10]; top-2 = experts 3, 1
    out = make_router(score_func="sigmoid", renormalize=False)(x)
    assert out.ids_TK.tolist() == [[3, 1]]
    close(out.weights_TK, [[0.9, 0.75]])
    out = make_router(score_func="sigmoid", renormalize=True)(x)
    close(out.weights_TK, [[0.9 / 1.65, 0.75 / 1.65]])


def test_aux_loss_formula() -> None:
    # Both tokens pick experts {2, 3}: f = [0, 0, 1/2, 1/2], P = [1/8, 1/8, 1/4, 1/2]
    out = make_router()(torch.tensor([ROW_A, ROW_A]))
    close(out.aux_loss, 4 * (0.5 * 0.25 + 0.5 * 0.5))
    close(out.tokens_per_expert_E, [0.0, 0.0, 2.0, 2.0])
    # Balanced selection gives exactly 1: f = 1/4 each, sum(P) = 1
    close(make_router()(torch.tensor([ROW_A, ROW_B])).aux_loss, 1.0)


def test_aux_loss_uses_reduced_global_counts() -> None:
    r = make_router()
    other_rank_counts = torch.tensor([2.0, 2.0, 0.0, 0.0])
    r.stats_reducer = lambda c: c + other_rank_counts
    out = r(torch.tensor([ROW_A, ROW_A]))
    close(out.aux_loss, 1.0)  # global counts [2, 2, 2, 2] -> f = 1/4
    close(out.tokens_per_expert_E, [0.0, 0.0, 2.0, 2.0])  # the local counts are reported


def test_aux_loss_gradient_flows_to_gate_only_through_probabilities() -> None:
    r = make_router()
    r(torch.tensor([ROW_A, ROW_A])).aux_loss.backward()
    # d aux / d logits_j = E/T * sum_t sum_i f_i p_i (delta_ij - p_j); check one entry by hand
    p = torch.tensor([1 / 8, 1 / 8, 1 / 4, 1 / 2])
    f = torch.tensor([0.0, 0.0, 0.5, 0.5])
    dlogit = 4 * (f * p - p * (f * p).sum())  # per token, mean over 2 identical tokens
    x = torch.tensor(ROW_A)
    torch.testing.assert_close(r.gate.weight.grad, torch.outer(dlogit, x), atol=1e-6, rtol=1e-5)


def test_z_loss_and_entropy() -> None:
    out = make_router()(torch.tensor([ROW_A, ROW_B]))
    close(out.z_loss, math.log(8.0) ** 2)  # logsumexp(ROW_A) = ln 8, same for ROW_B
    p = [1 / 8, 1 / 8, 1 / 4, 1 / 2]
    close(out.entropy, -sum(q * math.log(q) for q in p))


def test_bias_changes_selection_not_weights() -> None:
    r = make_router()
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    out = r(torch.tensor([ROW_A]))
    assert sorted(out.ids_TK[0].tolist()) == [0, 3]
    w = dict(zip(out.ids_TK[0].tolist(), out.weights_TK[0].tolist(), strict=True))
    # unbiased probs of experts 0 and 3 are 1/8 and 1/2, renormalised -> 1/5, 4/5
    assert w[0] == pytest.approx(0.2, abs=1e-6) and w[3] == pytest.approx(0.8, abs=1e-6)
    # the bias is a buffer, not a parameter: no gradient path
    assert "expert_bias" in dict(r.named_buffers()) and r.expert_bias.requires_grad is False


def test_update_bias_sign_rule() -> None:
    r = make_router(bias_update_rate=0.1)
    r.update_bias(torch.tensor([4.0, 0.0, 2.0, 2.0]))  # mean 2 -> sign = [-1, +1, 0, 0]
    close(r.expert_bias, [-0.1, 0.1, 0.0, 0.0])
    r.update_bias(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    close(r.expert_bias, [-0.2, 0.2, 0.0, 0.0])
    frozen = make_router(bias_update_rate=0.0)
    frozen.update_bias(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    close(frozen.expert_bias, [0.0, 0.0, 0.0, 0.0])


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_capacity_drops_lowest_score_first() -> None:
    # E=2, K=1, T=4, cf=1 -> capacity ceil(1 * 4 * 1 / 2) = 2; all tokens pick expert 0
    r = make_router(num_experts=2, top_k=1, renormalize=False, capacity_factor=1.0)
    probs = [0.6, 0.9, 0.7, 0.8]
    out = r(torch.tensor([[_logit(p), 0.0] for p in probs]))
    assert r.capacity(4) == 2
    assert out.ids_TK.flatten().tolist() == [0, 0, 0, 0]
    assert out.keep_TK.flatten().tolist() == [False, True, False, True]
    assert int(out.dropped) == 2
    close(out.tokens_per_expert_E, [4.0, 0.0])  # selections before capacity


def test_capacity_ties_keep_earlier_tokens_and_respect_each_expert() -> None:
    ids = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    prio = torch.tensor([[0.5, 0.5], [0.5, 0.4], [0.5, 0.5], [0.9, 0.5]])
    keep = capacity_keep(ids, prio, num_experts=3, capacity=2)
    # expert 0: four copies with 0.5 -> tokens 0 and 1 (earliest) kept
    # expert 1: 0.5 (t0), 0.4 (t1), 0.9 (t3) -> t3 and t0 kept; expert 2: one copy kept
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, False]]


def test_jitter_only_in_training() -> None:
    r = make_router(jitter=0.5)
    x = torch.randn(64, 4)
    ref = make_router()(x)
    out = r(x)  # eval mode
    torch.testing.assert_close(out.weights_TK, ref.weights_TK)
    r.train()
    torch.manual_seed(0)
    noisy = r(x)
    assert not torch.allclose(noisy.weights_TK, ref.weights_TK)
