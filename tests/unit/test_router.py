"""Router and balancing losses against values computed by hand on tiny inputs.

The gate is the identity (D = E), so the router logits are the inputs themselves.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import ConfigError, MoEConfig
from moetrain.model.moe.capacity import capacity_keep, expert_capacity
from moetrain.model.moe.dispatch import LocalDispatcher, Routes
from moetrain.model.moe.router import Router, limit_to_groups

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


def test_renormalisation_clamps_the_sum_at_renormalize_min() -> None:
    """``moe.renormalize_min`` (ERNIE-4.5's moe_norm_min): the chosen weights are divided by
    max(their sum, the minimum). It matters only where a selection bias picks experts whose
    scores are all but zero; 0 (the default) divides by the plain sum, bit for bit."""
    x = torch.tensor([[0.0, -30.0, -31.0, -40.0]])
    probs = torch.softmax(x, dim=-1)
    bias = torch.tensor([-10.0, 0.0, 0.0, 0.0])  # excludes expert 0: experts 1 and 2 chosen
    picked = probs[0, [1, 2]]
    assert picked.sum() < 1e-12
    for minimum, divisor in ((1e-12, torch.tensor(1e-12)), (0.0, picked.sum())):
        r = make_router(renormalize_min=minimum)
        with torch.no_grad():
            r.expert_bias.copy_(bias)
        out = r(x)
        assert out.ids_TK.tolist() == [[1, 2]]
        assert torch.equal(out.weights_TK[0], picked / divisor), minimum
    # where the sum is above the minimum, nothing changes
    plain, clamped = make_router()(torch.tensor([ROW_A])), make_router(renormalize_min=1e-12)
    assert torch.equal(clamped(torch.tensor([ROW_A])).weights_TK, plain.weights_TK)
    for kw in (dict(renormalize=False), dict(topk_before_score=True)):
        with pytest.raises(ConfigError, match=r"moe\.renormalize_min"):
            MoEConfig(renormalize_min=1e-12, **kw).validate()


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
    x = torch.tensor([[_logit(p), 0.0] for p in probs])
    out = r(x)
    assert expert_capacity(1.0, 4, 1, 2) == 2 and expert_capacity(0.0, 4, 1, 2) is None
    assert out.ids_TK.flatten().tolist() == [0, 0, 0, 0]
    close(out.tokens_per_expert_E, [4.0, 0.0])  # selections before capacity
    dispatcher = LocalDispatcher(2)
    routes = Routes(out.ids_TK, out.weights_TK, capacity_factor=1.0)
    assert dispatcher.capacity_keep(routes).flatten().tolist() == [False, True, False, True]
    d = dispatcher.dispatch(x, routes)
    assert d.counts_L.tolist() == [2, 0] and int(d.dropped) == 2
    assert torch.equal(d.x_ND, x[[1, 3]])


def test_capacity_groups_decide_each_part_on_its_own() -> None:
    """Two capacity groups (two EP groups' tokens in one process) = each part alone."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 4, (12, 2), generator=g)
    w = torch.rand(12, 2, generator=g).round(decimals=1)  # ties
    routes = Routes(ids, w, capacity_factor=0.5)
    both = LocalDispatcher(4, capacity_groups=2).capacity_keep(routes)
    one = LocalDispatcher(4)
    halves = [one.capacity_keep(Routes(ids[i : i + 6], w[i : i + 6], 0.5)) for i in (0, 6)]
    assert torch.equal(both, torch.cat(halves))
    assert not torch.equal(both, one.capacity_keep(routes))  # the whole batch decides otherwise


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


# ----------------------------------------------------------------------- aux-loss scopes
# P(A) = [1/8, 1/8, 1/4, 1/2] picks {2, 3}; P(B) = [1/2, 1/4, 1/8, 1/8] picks {0, 1}.


def test_micro_batch_scope_ignores_other_ranks() -> None:
    r = make_router(aux_loss_scope="micro_batch")
    r.stats_reducer = lambda c: c + torch.tensor([2, 2, 0, 0])  # never called by this scope
    # f = [0, 0, 1/2, 1/2] from this rank's two tokens
    close(r(torch.tensor([ROW_A, ROW_A])).aux_loss, 4 * (0.5 * 0.25 + 0.5 * 0.5))


def test_sequence_scope_balances_each_sequence() -> None:
    x = torch.tensor([ROW_A, ROW_B, ROW_A, ROW_A])
    # sequence [A, B]: f = 1/4 each -> 4 * 1/4 * sum(P) = 1; sequence [A, A]: 1.5 -> mean 1.25
    close(make_router(aux_loss_scope="sequence")(x, num_seqs=2).aux_loss, 1.25)
    # the same four tokens as one micro-batch: f = [1, 1, 3, 3] / 8, P = (3 P(A) + P(B)) / 4
    close(make_router(aux_loss_scope="micro_batch")(x).aux_loss, 4 * 72 / 256)
    # one sequence of four tokens is the micro-batch
    close(make_router(aux_loss_scope="sequence")(x, num_seqs=1).aux_loss, 4 * 72 / 256)


def test_global_batch_scope_accumulates_over_the_step() -> None:
    r = make_router(aux_loss_scope="global_batch").train()
    r.begin_step()
    close(r(torch.tensor([ROW_A, ROW_A])).aux_loss, 1.5)  # f from micro-step 1 only
    r.end_micro_batch()
    # micro-step 2: counts [2, 2, 0, 0] + [0, 0, 2, 2] -> f = 1/4: 4 * 1/4 * sum(P(B)) = 1
    close(r(torch.tensor([ROW_B, ROW_B])).aux_loss, 1.0)
    # activation checkpointing runs the forward again before the backward: counted once
    r(torch.tensor([ROW_B, ROW_B]))
    r.end_micro_batch()
    assert r.step_counts_E.tolist() == [2, 2, 2, 2]
    assert "step_counts_E" not in r.state_dict()  # not part of checkpoints
    r.begin_step()  # a new optimizer step starts from nothing
    close(r(torch.tensor([ROW_B, ROW_B])).aux_loss, 4 * (0.5 * 0.5 + 0.5 * 0.25))


def test_global_batch_scope_sums_over_ranks_and_not_in_eval() -> None:
    r = make_router(aux_loss_scope="global_batch").train()
    r.stats_reducer = lambda c: c + torch.tensor([1, 1, 0, 0])  # another rank's one token B
    r.begin_step()
    r(torch.tensor([ROW_A]))  # this rank's counts [0, 0, 1, 1] + [1, 1, 0, 0]
    r.end_micro_batch()
    assert r.step_counts_E.tolist() == [1, 1, 1, 1]
    r.eval()  # evaluation neither uses nor changes the step's counts
    close(r(torch.tensor([ROW_A])).aux_loss, 1.0)  # f = [1, 1, 1, 1] / 4 this micro-step
    r.end_micro_batch()
    assert r.step_counts_E.tolist() == [1, 1, 1, 1]


# ------------------------------------------------------------------ group-limited routing


def test_group_limited_routing_by_hand() -> None:
    # sigmoid scores [0.9, 0.1, 0.8, 0.7]; groups {0, 1} (score 0.9 + 0.1) and {2, 3} (1.5)
    x = torch.tensor([[_logit(0.9), _logit(0.1), _logit(0.8), _logit(0.7)]])
    plain = make_router(score_func="sigmoid", renormalize=False)(x)
    assert sorted(plain.ids_TK[0].tolist()) == [0, 2]
    grouped = make_router(score_func="sigmoid", renormalize=False, n_group=2, topk_group=1)(x)
    assert sorted(grouped.ids_TK[0].tolist()) == [2, 3]
    close(grouped.weights_TK.sort(descending=True).values, [[0.8, 0.7]])
    # the bias shifts the group scores as it shifts selection: +0.6 on expert 1 -> group 0 (1.6)
    r = make_router(score_func="sigmoid", renormalize=False, n_group=2, topk_group=1)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.6, 0.0, 0.0]))
    assert sorted(r(x).ids_TK[0].tolist()) == [0, 1]
    # groups of one expert: a group's score is that expert's; all groups = plain top-k
    assert torch.equal(limit_to_groups(x, 4, 4), x)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_experts=8, top_k=2, n_group=4, topk_group=1),
        dict(num_experts=8, top_k=3, n_group=4, topk_group=2),
        dict(num_experts=16, top_k=4, n_group=8, topk_group=3, score_func="sigmoid"),
        dict(num_experts=8, top_k=2, n_group=2, topk_group=1, topk_before_score=True),
    ],
)
def test_group_limited_experts_lie_in_topk_groups(kw: dict) -> None:
    r = make_router(**kw)
    x = torch.randn(256, kw["num_experts"], generator=torch.Generator().manual_seed(0))
    ids = r(x).ids_TK
    group_size = kw["num_experts"] // kw["n_group"]
    groups_per_token = [len(set((row // group_size).tolist())) for row in ids]
    assert max(groups_per_token) <= kw["topk_group"]
    assert all(len(set(row.tolist())) == kw["top_k"] for row in ids)  # K distinct experts
    if kw["topk_group"] > 1:
        assert max(groups_per_token) > 1


def test_group_scored_by_its_best_expert() -> None:
    # softmax-free check on sigmoid scores [0.9, 0.1, 0.8, 0.7]: top2_sum picks group {2, 3}
    # (1.5 > 1.0), max picks group {0, 1} (0.9 > 0.8)
    x = torch.tensor([[_logit(0.9), _logit(0.1), _logit(0.8), _logit(0.7)]])
    kw = dict(score_func="sigmoid", renormalize=False, n_group=2, topk_group=1)
    assert sorted(make_router(**kw)(x).ids_TK[0].tolist()) == [2, 3]
    assert sorted(make_router(group_score="max", **kw)(x).ids_TK[0].tolist()) == [0, 1]


def _hf_router(family: str, moe: MoEConfig, d_model: int):
    """transformers' DeepSeek-V2 / V3 router with the routing settings of ``moe``."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=d_model,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        routed_scaling_factor=moe.route_scale,
        norm_topk_prob=moe.renormalize,
    )
    if family == "v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        cfg = transformers.DeepseekV2Config(topk_method="group_limited_greedy", **common)
        return DeepseekV2TopkRouter(cfg)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return DeepseekV3TopkRouter(transformers.DeepseekV3Config(**common))


@pytest.mark.parametrize(
    "family, kw",
    [
        ("v2", dict(group_score="max", renormalize=False, route_scale=16.0)),
        ("v3", dict(score_func="sigmoid", renormalize=True, route_scale=2.5)),
    ],
)
def test_group_limited_routing_matches_transformers(family: str, kw: dict) -> None:
    moe = MoEConfig(num_experts=16, top_k=4, n_group=4, topk_group=2, **kw)
    d = 32
    ours = Router(moe, d_model=d).eval()
    theirs = _hf_router(family, moe, d)
    with torch.no_grad():
        ours.gate.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        theirs.weight.copy_(ours.gate.weight)
        if family == "v3":  # the selection bias shifts choice (and group scores), not weights
            bias = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.3
            ours.expert_bias.copy_(bias)
            theirs.e_score_correction_bias.copy_(bias)
    x = torch.randn(512, d, generator=torch.Generator().manual_seed(2))
    got = ours(x)
    _, ref_w, ref_ids = theirs(x)
    order_ours, order_ref = got.ids_TK.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order_ours.values, order_ref.values)
    torch.testing.assert_close(
        got.weights_TK.gather(1, order_ours.indices), ref_w.gather(1, order_ref.indices)
    )


@pytest.mark.parametrize("eps", [0.01, 0.3, 2.0])
def test_sparsemixer_is_transformers_eval_sparsemixer(eps: float) -> None:
    """moe.router_type=sparsemixer: the two experts and their weights equal transformers'
    Phi-3.5-MoE sparsemixer in eval mode (its inference) bit for bit, at the released eps and
    at wider ones where more logits share each pick's softmax."""
    phimoe = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    g = torch.Generator().manual_seed(0)
    logits = (
        torch.randn(64, 8, generator=g) * torch.tensor([0.1, 1.0, 3.0, 10.0]).repeat(16)[:, None]
    )
    r = make_router(num_experts=8, router_type="sparsemixer", renormalize=False)
    r.gate = torch.nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(8))
    r.cfg.router_jitter_eps = eps
    out = r(logits)
    want_w, want_ids = phimoe.sparsemixer(logits, jitter_eps=eps, training=False)
    assert torch.equal(out.ids_TK, want_ids)
    assert torch.equal(out.weights_TK, want_w)
    assert (out.weights_TK < 1).any()  # softmaxes over several logits...
    assert (out.weights_TK == 1).any() == (eps < 1)  # ...and, masked, over one


@pytest.mark.parametrize("eps", [0.3, 2.0])
def test_sparsemixer_gradient_is_phimoe_multipliers_at_the_argmax(eps: float) -> None:
    """moetrain's sparsemixer gradient (autograd of its deterministic forward) equals
    transformers' training-mode backward (PhimoeMultiplier) on the draw where its Gumbel sample
    is the argmax and its Heun coin gives 1."""
    phimoe = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    from moetrain.model.moe.sparsemixer import sparsemixer_top2

    g = torch.Generator().manual_seed(1)
    base = torch.randn(32, 6, generator=g)
    upstream = torch.randn(32, 2, generator=g)

    def reference(scores: torch.Tensor) -> torch.Tensor:
        """transformers' training path with the sampled expert = the argmax, mask_for_one 1."""
        outs, masked_scores = [], scores
        for _ in range(2):
            with torch.no_grad():
                best, ids = masked_scores.max(dim=-1, keepdim=True)
                far = ((best - scores) / scores.abs().clamp(min=best)) > 2 * eps
            gates = torch.softmax(masked_scores.masked_fill(far, float("-inf")), dim=-1)
            weight = gates.gather(-1, ids)
            outs.append(
                phimoe.PhimoeMultiplier.apply(scores, weight, ids, gates, torch.ones_like(weight))
            )
            masked_scores = torch.scatter(scores, -1, ids, float("-inf"))
        return torch.cat(outs, dim=-1)

    grads = []
    for fn in (reference, lambda s: sparsemixer_top2(s, eps)[0]):
        scores = base.clone().requires_grad_()
        (fn(scores) * upstream).sum().backward()
        grads.append(scores.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-7, rtol=1e-6)
    assert grads[0].abs().max() > 1e-3


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(top_k=3), "moe.top_k"),
        (dict(score_func="sigmoid"), "moe.score_func"),
        (dict(topk_before_score=True), "moe.topk_before_score"),
        (dict(renormalize=True), "moe.renormalize"),
        (dict(n_group=2), "moe.n_group"),
        (dict(bias_update_rate=0.1), "moe.bias_update_rate"),
    ],
)
def test_sparsemixer_refuses_what_it_does_not_compute_by_key(kw: dict, key: str) -> None:
    cfg = MoEConfig(**{"num_experts": 4, "router_type": "sparsemixer", "renormalize": False, **kw})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cfg.validate()
