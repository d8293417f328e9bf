"""Nemotron 3 (``nemotron_h``) and the model options it needs, each against a written-out
reference: squared-ReLU experts that are not gated (``moe.activation: relu2``), the squared-ReLU
dense MLP and shared expert (``model.ffn_activation: relu2``), the latent MoE
(``moe.latent_dim``), its router (DeepSeek-V3's rule as transformers computes it), the block
pattern (each block one sublayer); the family both ways over rows of many Mamba-2 chunks and
packed documents; what moetrain refuses, by key."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.checkpoint.read import load_model
from moetrain.config import Config, ConfigError
from moetrain.config.layer_plan import layer_plan
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.families import nemotron_h
from moetrain.convert.formats import choose_format
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.init_from.upcycle import check_upcycle
from moetrain.model import Transformer
from moetrain.model.cpu_matmul import use_cpu_matmul
from moetrain.model.layers import ReluSquaredMLP
from moetrain.model.moe.experts import GroupedExperts
from moetrain.model.moe.layer import MoELayer
from moetrain.model_numbers import model_numbers
from tests.helpers.configs import tiny_config
from tests.helpers.convert_cases import tiny_cfg
from tests.helpers.hf_models import hf_config, save_hf_model, save_hf_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def torch_matmul():
    """transformers' matrix kernel on both sides (see tests/unit/test_released_configs.py)."""
    use_cpu_matmul("torch")
    yield
    use_cpu_matmul("onednn")


def _relu2(h: torch.Tensor) -> torch.Tensor:
    return torch.where(h > 0, h * h, torch.zeros_like(h))


@pytest.mark.parametrize(("grouped", "recompute"), [(True, False), (False, False), (True, True)])
def test_relu2_experts_match_a_per_expert_reference(grouped: bool, recompute: bool) -> None:
    """Expert e computes ``relu(x W13[e])^2 W2[e]`` times the routing weight, W13 (D, F) the up
    projection alone; values and gradients, grouped GEMM, loop and recomputed activation."""
    torch.manual_seed(0)
    ex = GroupedExperts(4, 8, 6, grouped, recompute_act=recompute, activation="relu2")
    ex.reset_parameters(0.5, 0.5)
    assert ex.w13.shape == (4, 8, 6)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = torch.rand(10, generator=torch.Generator().manual_seed(2), requires_grad=True)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        outs.append(_relu2(x[rows] @ ex.w13[e]) @ ex.w2[e] * w[rows, None])
        start += n
    got, ref = ex(x, counts, w), torch.cat(outs)
    assert (x @ ex.w13[0] < 0).any()  # (the ReLU cuts somewhere)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    params, grad = [x, w, ex.w13, ex.w2], torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad(got, params, grad), torch.autograd.grad(ref, params, grad), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_weighted_relu2_in_bf16_computes_in_the_weights_dtype() -> None:
    """bf16 rows with fp32 routing weights: the squared ReLU and its weighting in fp32,
    rounded once; the gradients are the fp32 composition's (h's rounded to bf16)."""
    from moetrain.model.layers import relu2_packed

    h = (torch.randn(40, 12) * 2).bfloat16().requires_grad_()
    w = torch.rand(40, requires_grad=True)
    out = relu2_packed(h, w)
    h32 = h.detach().float().requires_grad_()
    want = _relu2(h32) * w.detach()[:, None]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want.bfloat16(), atol=0, rtol=0)
    g = torch.randn(40, 12)
    out.float().backward(g)
    w32 = w.detach().clone().requires_grad_()
    (_relu2(h32) * w32[:, None]).backward(g.bfloat16().float())
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad, h32.grad.bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(w.grad, w32.grad, atol=1e-6, rtol=1e-6)


def test_relu2_mlp_is_the_written_formula() -> None:
    torch.manual_seed(0)
    mlp = ReluSquaredMLP(8, 12)
    x = torch.randn(5, 8)
    torch.testing.assert_close(mlp(x), _relu2(x @ mlp.w1.weight.t()) @ mlp.w2.weight.t())
    assert [n for n, _ in mlp.named_parameters()] == ["w1.weight", "w2.weight"]


def _nemotron_moe(**moe: object) -> Config:
    base = {
        "moe.score_func": "sigmoid",
        "moe.activation": "relu2",
        "model.ffn_activation": "relu2",
        "moe.num_experts": 8,
        "moe.top_k": 3,
        "moe.n_group": 4,
        "moe.topk_group": 2,
        "moe.route_scale": 2.5,
        "moe.num_shared_experts": 1,
        "moe.shared_expert_hidden": 20,
    }
    return tiny_config(base, {f"moe.{k}": v for k, v in moe.items()})


def _deepseek_v3_route(logits: torch.Tensor, bias: torch.Tensor, cfg) -> tuple:  # noqa: ANN001
    """transformers' DeepSeek-V3 router (NemotronHTopkRouter), written out: sigmoid scores;
    the selection adds the bias; each group scored by its two best biased scores, the best
    ``topk_group`` groups kept; top-k among them; the weights the unbiased scores of the
    chosen, divided by their sum (+1e-20), times ``routed_scaling_factor``."""
    t, e = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias
    groups = choice.view(t, cfg.n_group, e // cfg.n_group).topk(2, -1).values.sum(-1)
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(cfg.topk_group, -1).indices, 1)
    mask = keep.repeat_interleave(e // cfg.n_group, dim=1).bool()
    ids = choice.masked_fill(~mask, float("-inf")).topk(cfg.top_k, -1).indices
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * cfg.route_scale, ids


def test_router_is_deepseek_v3s_rule_as_transformers_computes_it() -> None:
    cfg = _nemotron_moe().moe
    torch.manual_seed(0)
    layer = MoELayer(cfg, 32)
    with torch.no_grad():
        layer.router.gate.weight.normal_()
        layer.router.expert_bias.uniform_(-0.3, 0.3)
    x = torch.randn(64, 32)
    out = layer.router(x)
    logits = x @ layer.router.gate.weight.t()
    w, ids = _deepseek_v3_route(logits, layer.router.expert_bias, cfg)
    order, ref_order = out.ids_TK.sort(-1), ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(
        out.weights_TK.gather(1, order.indices), w.gather(1, ref_order.indices)
    )
    # (the groups bind: without them other experts are chosen for some tokens)
    free = _deepseek_v3_route(
        logits, layer.router.expert_bias, _nemotron_moe(n_group=1, topk_group=1).moe
    )[1]
    assert not torch.equal(free.sort(-1).values, ref_order.values)


def test_latent_moe_matches_a_written_reference() -> None:
    """The routed experts compute in the latent: ``latent_out(sum_k w_k relu(latent_in(x)
    W13)^2 W2) + shared(x)``, the router and the shared expert reading x itself."""
    cfg = _nemotron_moe(latent_dim=12).moe
    torch.manual_seed(0)
    layer = MoELayer(cfg, 32, shared_activation="relu2")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    assert layer.experts.w13.shape == (8, 12, cfg.expert_hidden)
    assert layer.latent_in.weight.shape == (12, 32) and layer.latent_out.weight.shape == (32, 12)
    x = torch.randn(2, 9, 32)
    got, _ = layer(x)
    flat = x.reshape(-1, 32)
    logits = flat @ layer.router.gate.weight.t()
    w, ids = _deepseek_v3_route(logits, layer.router.expert_bias, cfg)
    latent = flat @ layer.latent_in.weight.t()
    routed = torch.zeros_like(latent)
    for t in range(flat.shape[0]):
        for k in range(cfg.top_k):
            e = ids[t, k]
            routed[t] += w[t, k] * (_relu2(latent[t] @ layer.experts.w13[e]) @ layer.experts.w2[e])
    shared = layer.shared_expert
    want = routed @ layer.latent_out.weight.t() + shared.w2(_relu2(shared.w1(flat)))
    torch.testing.assert_close(got.reshape(-1, 32), want, atol=1e-5, rtol=1e-5)


def test_each_block_is_one_sublayer_of_the_pattern() -> None:
    """``hybrid_override_pattern`` ``ME*E-M``: Mamba-2 and attention blocks without an FFN, MoE
    and MLP blocks without a mixer; the attention layer without RoPE."""
    cfg = nemotron_h.from_hf(hf_config("nemotron_h"))
    plan = layer_plan(cfg.model, cfg.moe)
    kinds = [(b.mixer.kind if b.mixer else None, b.ffn) for b in plan]
    assert kinds == [
        ("mamba2", "none"),
        (None, "moe"),
        ("gqa", "none"),
        (None, "moe"),
        (None, "dense"),
        ("mamba2", "none"),
    ]
    assert not plan[2].mixer.rope
    names = set(Transformer(cfg.model, cfg.moe).state_dict())
    assert {"layers.0.attn_norm.weight", "layers.1.ffn_norm.weight"} <= names
    assert not {"layers.0.ffn_norm.weight", "layers.1.attn_norm.weight"} & names
    assert {"layers.4.ffn.w1.weight", "layers.4.ffn.w2.weight"} <= names
    assert "layers.4.ffn.w3.weight" not in names  # (not gated)
    assert {"layers.1.ffn.latent_in.weight", "layers.1.ffn.latent_out.weight"} <= names


def test_parameter_counts_match_the_built_model() -> None:
    """model_numbers counts the squared-ReLU MLPs and experts (two matrices each) and the
    latent MoE's projections and latent experts as built."""
    cfg = tiny_cfg("nemotron_h")
    model = Transformer(cfg.model, cfg.moe)
    n = model_numbers(cfg)
    assert n.total_params == sum(p.numel() for p in model.parameters())
    named = dict(model.named_parameters())
    assert n.expert_params == sum(p.numel() for k, p in named.items() if ".experts." in k)
    e = cfg.moe
    idle = n.num_moe_layers * (e.num_experts - e.top_k) * 2 * e.latent_dim * e.expert_hidden
    assert n.active_params == n.total_params - idle


@pytest.mark.parametrize(("dtype", "recompute"), [(torch.float32, False), (torch.bfloat16, True)])
def test_plan_activations_match_saved_tensors(dtype: torch.dtype, recompute: bool) -> None:
    """``moetrain plan``'s bytes per token of the squared-ReLU MLPs and experts and the latent
    MoE equal what autograd saves (as tests/unit/test_plan.py measures them)."""
    from moetrain.plan.activations import activation_bytes_per_token, head_bytes_per_token
    from tests.unit.test_plan import _saved_bytes_per_token, _small

    cfg = _small(
        {
            "model.n_layers": 3,
            "model.ffn_activation": "relu2",
            "model.dense_hidden": 160,
            "moe.layer_ffns": ["dense", "moe", "moe"],
            "moe.activation": "relu2",
            "moe.recompute_act": recompute,
            "moe.num_shared_experts": 1,
            "moe.latent_dim": 48,
            "model.loss_chunk_tokens": 0,
        }
    )
    a, tokens = (4 if dtype == torch.float32 else 2), 512
    predicted = sum(activation_bytes_per_token(cfg, i, a) for i in range(cfg.model.n_layers))
    predicted += head_bytes_per_token(cfg, a)
    assert _saved_bytes_per_token(cfg, dtype, tokens) == pytest.approx(predicted, rel=0.01)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the logits' scale (fp32)."""
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_long_rows_and_packed_documents_both_ways(tmp_path) -> None:
    """A row of 88 tokens (11 Mamba-2 chunks of 8) both ways; a packed row of documents of 40,
    1 and 47 tokens equals transformers' logits of each document alone; the tolerance catches
    the routing without its groups (a real difference of the function)."""
    tok = save_hf_tokenizer(["def f(x):\n    return x + 1"] * 20, 300, tmp_path / "tok")
    long = {"max_position_embeddings": 256}
    src = save_hf_model("nemotron_h", tmp_path / "src", tokenizer=tok, overrides=long)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 88), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt")
    model, cfg = load_model(ckpt)
    model.eval()
    lengths = [40, 1, 47]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    with torch.no_grad():
        _close(model(ids).logits, ref)
        packed = model(ids[:1], doc_ids_BS=docs).logits
        alone = torch.cat([hf(input_ids=d).logits for d in ids[:1].split(lengths, dim=1)], 1)
        _close(packed, alone)
        assert (packed - ref[:1]).abs().max() > 1e-3 * ref.abs().max()  # (documents bind)
        ungrouped = Transformer(
            cfg.model, dataclasses.replace(cfg.moe, n_group=1, topk_group=1)
        ).eval()
        ungrouped.load_state_dict(model.state_dict())
        assert (ungrouped(ids).logits - ref).abs().max() > 1e-3 * ref.abs().max()
    out = convert_checkpoint(ckpt, tmp_path / "hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        _close(again(input_ids=ids).logits, ref)


def _refusal_case(**changes: object) -> Config:
    cfg = tiny_cfg("nemotron_h")
    model = {k: v for k, v in changes.items() if not k.startswith("moe_")}
    moe = {k[4:]: v for k, v in changes.items() if k.startswith("moe_")}
    return Config(
        model=dataclasses.replace(cfg.model, **model), moe=dataclasses.replace(cfg.moe, **moe)
    )


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        (dict(moe_activation="swiglu"), "moe.activation"),
        (dict(ffn_activation="swiglu"), "model.ffn_activation"),
        (dict(nope_layers=None), "model.nope_layers"),
        (dict(tie_embeddings=True), "model.tie_embeddings"),
        (
            dict(
                rope_scaling="llama3",
                rope_factor=8.0,
                rope_original_max_seq_len=16,
                rope_low_freq_factor=1.0,
                rope_high_freq_factor=4.0,
            ),
            "model.rope_scaling",
        ),
        (dict(moe_num_shared_experts=0, moe_shared_expert_hidden=None), "moe.num_shared_experts"),
        (dict(moe_score_func="softmax"), "moe.score_func"),
        (  # an attention block with an FFN: not one of its block kinds
            dict(moe_layer_ffns=["none", "moe", "dense", "moe", "dense"]),
            "model.layer_types",
        ),
    ],
)
def test_export_refuses_what_its_class_does_not_hold_by_key(changes: dict, key: str) -> None:
    assert choose_format(tiny_cfg("nemotron_h"), "nemotron_h") == "nemotron_h"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(_refusal_case(**changes), "nemotron_h")


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"moe.activation": "relu2"}, "moe.activation"),
        ({"model.ffn_activation": "relu2"}, "model.ffn_activation"),
        ({"moe.latent_dim": 16}, "moe.latent_dim"),
    ],
)
def test_other_families_refuse_its_pieces_by_key(extra: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(tiny_config(extra), "mixtral")


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [
        ("mlp_hidden_act", "gelu", "mlp_hidden_act"),
        ("mamba_hidden_act", "gelu", "mamba_hidden_act"),
        ("mlp_bias", True, "mlp_bias"),
        ("tie_word_embeddings", True, "tie_word_embeddings"),
    ],
)
def test_import_refuses_what_moetrain_does_not_compute_by_field(field, value, key) -> None:
    hf = hf_config("nemotron_h")
    setattr(hf, field, value)
    with pytest.raises(ConfigError, match=key):
        nemotron_h.from_hf(hf)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (  # Mamba-2's heads split over the sequence-parallel ranks
            {"parallel.sp_size": 3, "parallel.ep_size": 1},
            "parallel.sp_size: must divide model.mamba_num_heads",
        ),
        ({"optim.name": "muon"}, "moe.activation"),
        ({"moe.latent_dim": 0}, "moe.latent_dim"),
    ],
)
def test_training_refuses_what_it_cannot_run_by_key(extra: dict, key: str) -> None:
    cfg = tiny_cfg("nemotron_h")
    data = {f"model.{k}": v for k, v in vars(cfg.model).items()}
    data |= {f"moe.{k}": v for k, v in vars(cfg.moe).items()}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(data, extra)


def test_upcycling_into_relu2_or_latent_experts_is_refused_by_key() -> None:
    for extra, key in (
        ({"moe.latent_dim": 8}, "moe.latent_dim"),
        ({"moe.activation": "relu2"}, "moe.activation"),
        ({"model.ffn_activation": "relu2"}, "model.ffn_activation"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_upcycle(tiny_config({"moe.expert_hidden": 48}, extra), 48)
