"""DeepSeek-V4's routing pieces: the ``sqrtsoftplus`` score and hash routing (a fixed token-id ->
experts table), against a written-out reference and transformers' own routers (values and
gradients), the table's determinism (every rank, every expert-parallel layout routes alike), the
config's refusals, and the hash-routed load metric."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ConfigError, MoEConfig
from moetrain.convert.families import family
from moetrain.convert.families.holds import BASELINE
from moetrain.model.moe.router import Router, hash_table
from moetrain.model.transformer import Transformer
from moetrain.monitor.moe_health import LayerStats, moe_health_metrics
from tests.helpers.configs import tiny_config

E, K, D, V, T = 8, 3, 16, 50, 24


def make_router(layer: int = 0, **kw) -> Router:
    cfg = MoEConfig(num_experts=E, top_k=K, score_func="sqrtsoftplus", **kw)
    torch.manual_seed(1)
    return Router(cfg, D, vocab_size=V, layer=layer)


def reference(x, weight, bias, ids, table, route_scale):  # noqa: ANN001, ANN201
    """The rule written out: scores sqrt(softplus(x W^T)); the top-k of scores + bias, or the
    table's row for each token id; the chosen scores over their sum, times route_scale."""
    scores = torch.sqrt(torch.log1p(torch.exp(x @ weight.T)))
    chosen = torch.topk(scores + bias, K, dim=-1).indices if table is None else table[ids]
    w = torch.gather(scores, 1, chosen)
    return w / w.sum(-1, keepdim=True) * route_scale, chosen


@pytest.mark.parametrize("hashed", [False, True], ids=["topk", "hash"])
def test_routes_as_written_out(hashed: bool) -> None:
    router = make_router(hash_layers=[0] if hashed else None, route_scale=1.5)
    torch.manual_seed(2)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(E) * 0.1)
    x = torch.randn(T, D, requires_grad=True)
    ids = torch.randint(0, V, (T,))
    out = router(x, token_ids_T=ids)
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = router.gate.weight.detach().clone().requires_grad_(True)
    table = router.token_experts if hashed else None
    want, chosen = reference(x_ref, w_ref, router.expert_bias, ids, table, 1.5)
    assert torch.equal(out.ids_TK.sort(-1).values, chosen.sort(-1).values)
    order = out.ids_TK.argsort(-1), chosen.argsort(-1)
    got_sorted = out.weights_TK.gather(1, order[0])
    want_sorted = want.gather(1, order[1])
    torch.testing.assert_close(got_sorted, want_sorted, rtol=1e-6, atol=1e-7)
    g = torch.randn_like(want_sorted)
    (got_sorted * g).sum().backward()
    (want_sorted * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(router.gate.weight.grad, w_ref.grad, rtol=1e-5, atol=1e-7)
    # negative control: sigmoid scores (the nearest rule) miss the tolerance
    sig = torch.sigmoid(x_ref.detach() @ w_ref.detach().T).gather(1, chosen)
    assert not torch.allclose(sig / sig.sum(-1, keepdim=True) * 1.5, want, rtol=1e-6, atol=1e-7)


def test_matches_transformers_routers() -> None:
    """transformers' DeepseekV4TopKRouter and DeepseekV4HashRouter on the same weights, table
    and (non-zero) selection bias."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    hf_cfg = DeepseekV4Config(
        vocab_size=V, hidden_size=D, n_routed_experts=E, num_experts_per_tok=K,
        routed_scaling_factor=1.5, num_hidden_layers=2,
    )  # fmt: skip
    torch.manual_seed(3)
    x = torch.randn(2, T // 2, D)
    ids = torch.randint(0, V, (2, T // 2))
    for hashed in (False, True):
        ours = make_router(hash_layers=[0] if hashed else None, route_scale=1.5)
        theirs = (v4.DeepseekV4HashRouter if hashed else v4.DeepseekV4TopKRouter)(hf_cfg)
        with torch.no_grad():
            theirs.weight.copy_(ours.gate.weight)
            if hashed:
                theirs.tid2eid.copy_(ours.token_experts)
            else:
                ours.expert_bias.copy_(torch.randn(E) * 0.1)
                theirs.e_score_correction_bias.copy_(ours.expert_bias)
        got = ours(x.reshape(-1, D), token_ids_T=ids.reshape(-1))
        logits, weights, indices = theirs(x, ids) if hashed else theirs(x)
        mine = got.ids_TK.argsort(-1)
        order = indices.argsort(-1)
        assert torch.equal(got.ids_TK.gather(1, mine), indices.gather(1, order))
        torch.testing.assert_close(
            got.weights_TK.gather(1, mine), weights.gather(1, order), rtol=1e-6, atol=1e-7
        )


def test_table_is_deterministic_and_distinct() -> None:
    """The same table whatever the global RNG (every rank alike), another per layer, k
    distinct experts per token, every expert used; a buffer that is saved but never trained."""
    a = make_router(layer=2, hash_layers=[2])
    torch.manual_seed(99)
    torch.rand(1000)
    b = make_router(layer=2, hash_layers=[2])
    assert torch.equal(a.token_experts, b.token_experts)
    assert torch.equal(a.token_experts, hash_table(V, E, K, 2))
    assert not torch.equal(hash_table(V, E, K, 3), a.token_experts)
    t = a.token_experts
    assert t.shape == (V, K) and t.dtype == torch.int64
    assert (t.sort(-1).values.diff(dim=-1) > 0).all()  # distinct
    assert set(t.flatten().tolist()) == set(range(E))
    assert "token_experts" in dict(a.named_buffers()) and "token_experts" in a.state_dict()
    assert all("token_experts" not in n for n, _ in a.named_parameters())
    # the table selects, not the bias: an aux-loss-free update leaves a hashed router's bias
    c = make_router(layer=2, hash_layers=[2], bias_update_rate=0.1)
    c.update_bias(torch.arange(E, dtype=torch.float32))
    assert torch.count_nonzero(c.expert_bias) == 0


def test_model_routes_hashed_layer_by_token_ids() -> None:
    """In the model: the hashed layer's selection is the table's rows of the input ids, the same
    in a model built with a slice of the experts (an expert-parallel rank's), and survives
    ``init_weights``."""
    cfg = tiny_config(moe__score_func="sqrtsoftplus", moe__hash_layers=[1], moe__top_k=2)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    table = model.layers[1].ffn.router.token_experts
    assert model.layers[0].ffn.router.token_experts is None
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8))
    out = model(ids, labels_BS=ids)
    want = torch.zeros(cfg.moe.num_experts)
    want.scatter_add_(0, table[ids.reshape(-1)].reshape(-1), torch.ones(ids.numel() * 2))
    torch.testing.assert_close(out.moe[1].tokens_per_expert_E, want)
    out.loss.backward()
    assert model.layers[1].ffn.router.gate.weight.grad.abs().sum() > 0
    torch.manual_seed(5)
    rank = Transformer(cfg.model, cfg.moe, local_experts=(2, 4))
    assert torch.equal(rank.layers[1].ffn.router.token_experts, table)
    model.init_weights()
    assert torch.equal(model.layers[1].ffn.router.token_experts, table)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"moe__hash_layers": [2]}, "moe.hash_layers"),  # past n_layers
        ({"moe__hash_layers": [0], "moe__first_k_dense": 1}, "moe.hash_layers"),  # dense layer
        ({"moe__hash_layers": [0, 0]}, "moe.hash_layers"),
        ({"moe__hash_layers": [0], "moe__topk_before_score": True}, "moe.hash_layers"),
        ({"moe__score_func": "sqrtsofplus"}, "moe.score_func"),
    ],
)
def test_bad_settings_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(**overrides)


def test_families_refuse_by_key() -> None:
    """A family without the pieces names them (DeepSeek-V3: sigmoid, no hash routing)."""
    cfg = tiny_config(moe__score_func="sqrtsoftplus", moe__hash_layers=[0])
    keys = [k for k, _ in family("deepseek_v3").problems(cfg.model, cfg.moe)]
    assert "moe.score_func" in keys and "moe.hash_layers" in keys
    assert BASELINE["moe.hash_layers"].refused("moe.hash_layers", cfg.model, cfg.moe)


def test_hash_routed_load_metric() -> None:
    """moe/hash_imbalance_max_over_mean: the worst hash-routed layer's load alone."""
    stats = {
        0: LayerStats(tokens_per_expert=torch.tensor([4.0, 4.0, 4.0, 4.0])),
        1: LayerStats(tokens_per_expert=torch.tensor([8.0, 4.0, 4.0, 0.0])),
        2: LayerStats(tokens_per_expert=torch.tensor([13.0, 1.0, 1.0, 1.0])),
    }
    m = moe_health_metrics(stats, hash_layers=[0, 1])
    assert m["moe/hash_imbalance_max_over_mean"] == pytest.approx(2.0)
    assert m["moe/hash_dead_experts"] == 1.0
    assert m["moe/imbalance_max_over_mean"] == pytest.approx(3.25)
    assert "moe/hash_imbalance_max_over_mean" not in moe_health_metrics(stats)


def test_sqrtsoftplus_probabilities_sum_to_one() -> None:
    """The balancing loss's P_e under sqrtsoftplus: the scores over their sum."""
    router = make_router()
    x = torch.randn(T, D)
    out = router(x)
    scores = F.softplus(router.gate(x)).sqrt()
    probs = scores / scores.sum(-1, keepdim=True)
    frac = out.tokens_per_expert_E / out.tokens_per_expert_E.sum()
    torch.testing.assert_close(out.aux_loss, E * (frac * probs.mean(0)).sum())


def test_checkpoint_round_trip_keeps_the_table_and_the_streams(tmp_path) -> None:
    """A checkpoint of a model with hash routing and hyper-connections loads back to the same
    table, parameters and logits."""
    from moetrain.checkpoint.read import load_model
    from moetrain.checkpoint.write import write_checkpoint
    from moetrain.model import param_names as pn

    cfg = tiny_config(moe__score_func="sqrtsoftplus", moe__hash_layers=[0], model__hc_streams=2)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    with torch.no_grad():  # (a table no fresh model would draw)
        model.layers[0].ffn.router.token_experts.copy_(
            model.layers[0].ffn.router.token_experts.flip(0)
        )
    state = model.state_dict()
    parts = [("dense", {k: v for k, v in state.items() if not pn.parse_experts(k)})]
    for layer in cfg.moe.moe_layers(cfg.model.n_blocks):
        prefix = f"layers.{layer}."
        experts = {k: v for k, v in state.items() if pn.parse_experts(k) and k.startswith(prefix)}
        parts.append((f"layers.{layer}", experts))
    loaded, _ = load_model(write_checkpoint(tmp_path / "c", cfg, parts))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_step_metrics_carry_the_hash_routed_load() -> None:
    """What metrics.jsonl gets for a step (``records.step_metrics``): the hash-routed layers'
    load beside every layer's."""
    from moetrain.monitor.records import step_metrics

    cfg = tiny_config(moe__score_func="sqrtsoftplus", moe__hash_layers=[0])
    layer = {"dropped": 0, "entropy": 1.0, "aux_loss": 1.0, "z_loss": 0.1, "dropped_frac": 0.0}
    rec = {
        "step": 1,
        "ce_loss": 2.0,
        "moe_layers": {
            0: {**layer, "tokens_per_expert": [6.0, 2.0, 0.0, 0.0]},
            1: {**layer, "tokens_per_expert": [2.0, 2.0, 2.0, 2.0]},
        },
    }
    row = step_metrics(rec, cfg, None, 1)
    assert row["moe/hash_imbalance_max_over_mean"] == pytest.approx(3.0)
    assert row["moe/hash_dead_experts"] == 2.0
    assert row["moe/layer0/tokens_per_expert"] == [6.0, 2.0, 0.0, 0.0]
