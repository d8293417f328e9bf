"""DeepSeek sparse attention under sequence parallelism, exact at the layer: every slice's rank (a
thread, the Ulysses layout's all-to-all a swap, :mod:`tests.helpers.threaded_exchange`) runs
its queries (every head) against the whole rows' keys, gathered (the latent and rotary key, the
indexer's key). A layer with its own indexer and one that shares its selection, in fp64 (the
indexer scores in fp32, as it does in every precision), packed documents that cross the slices:
the outputs, the input's and every parameter's gradients (summed over the ranks) and the
indexers' KL, loss and recall (their mean over the ranks, as the step's metrics take it) equal
one call on the whole rows, in the sparse stage and in the dense warm-up (its KL over every key,
its dense attention through the head exchange). Controls: the keys' gradients not returned to
the rank that holds them, and the slices in the wrong order, are caught."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.config.layer_plan import mixer_spec
from moetrain.model import sparse_latent
from moetrain.model.doc_attention import Documents
from moetrain.model.head_exchange import gather_sequence
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.rope import model_rope_tables
from tests.helpers.configs import tiny_config
from tests.helpers.threaded_exchange import run_sliced

B, S, D = 2, 24, 32  # (the tiny model's d_model)
DSA = {
    "model.attention": "mla",
    "model.n_layers": 2,
    "model.n_kv_heads": 4,
    "model.q_lora_rank": 12,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 12,
    "model.index_topk": 4,
    "model.index_n_heads": 2,
    "model.index_head_dim": 8,
    "model.index_recall_queries": 16,  # positions 8..23: both slices at 2 ranks
    "model.indexer_types": ["full", "shared"],
    "parallel.zero_stage": 0,
}
# documents start inside slices and at none of the cuts of 2 and 4 ranks (6, 12, 18)
DOCS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10, [0] * 13 + [1] * 2 + [2] * 9])
# the indexer's scores, KL and their gradients are fp32 (as in every precision): sums over the
# positions taken per slice and added show its rounding
REL = 1e-6
REPORTED: dict[object, list] = {}


class _Stack(nn.Module):
    """Layer 0 (its own indexer) and layer 1 (the layer-0 selection), called as a model's blocks
    call them (one ``MixerInputs``)."""

    def __init__(self, cfg) -> None:  # noqa: ANN001
        super().__init__()
        self.layers = nn.ModuleList(build_mixer(cfg, mixer_spec(cfg, i)) for i in range(2))

    def set_head_exchange(self, ex) -> None:  # noqa: ANN001
        for layer in self.layers:
            layer.set_head_exchange(ex)


def _stack(stage: str) -> tuple[_Stack, tuple[torch.Tensor, torch.Tensor]]:
    cfg = tiny_config(DSA, {"model.index_stage": stage}).model
    torch.manual_seed(0)
    stack = _Stack(cfg).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every parameter random, attention scores of order one
        for p in stack.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.4)
    return stack, tuple(t.double() for t in model_rope_tables(cfg, S))


def _caller(tables: tuple[torch.Tensor, torch.Tensor]):  # noqa: ANN202
    def call(stack: _Stack, x: torch.Tensor):  # noqa: ANN202
        ex = stack.layers[0].head_exchange
        rank, ranks, s = (ex.rank, ex.size, x.shape[1]) if ex else ("whole", 1, S)
        first = 0 if ex is None else rank * s
        cos, sin = (t[first : first + s] for t in tables)
        inputs = MixerInputs(cos, sin, Documents.from_ids(DOCS), DOCS)
        h = x + stack.layers[0](x, inputs)
        out = stack.layers[1](h, inputs)
        REPORTED[rank] = inputs.losses
        # each rank's loss is the mean over its queries; the data-parallel mean over the ranks
        return out, sum(own.loss for own in inputs.losses) / ranks

    return call


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _whole(stack: _Stack, call, x: torch.Tensor, probe: torch.Tensor):  # noqa: ANN001, ANN202
    x = x.clone().requires_grad_()
    out, loss = call(stack, x)
    ((out * probe).sum() + loss).backward()
    grads = {n: p.grad.clone() for n, p in stack.named_parameters() if p.grad is not None}
    stack.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, D, generator=gen, dtype=torch.float64)
    return x, torch.randn(B, S, D, generator=gen, dtype=torch.float64)


def _reported(key: object, metric: str) -> torch.Tensor:
    """Each layer's ``metric`` (``loss``: its weighted KL) that call ``key`` reported."""
    return torch.stack(
        [own.loss.detach() if metric == "loss" else own.metrics[metric] for own in REPORTED[key]]
    )


CASES = [
    pytest.param("sparse", 2, id="sparse-sp2"),
    pytest.param("dense_warmup", 2, id="warmup-sp2"),
    pytest.param("sparse", 4, id="sparse-sp4", marks=pytest.mark.long),
    pytest.param("dense_warmup", 4, id="warmup-sp4", marks=pytest.mark.long),
]


@pytest.mark.parametrize(("stage", "sp"), CASES)
def test_sequence_parallel_sparse_attention_equals_the_whole_rows(stage: str, sp: int) -> None:
    stack, tables = _stack(stage)
    assert tiny_config(DSA, {"model.index_stage": stage, "parallel.sp_size": sp})  # allowed
    call = _caller(tables)
    x, probe = _inputs()
    REPORTED.clear()
    want_out, want_dx, want_grads = _whole(stack, call, x, probe)
    out, dx, grads = run_sliced(stack, sp, x, probe, call)
    assert _rel(out, want_out) < REL
    assert _rel(dx, want_dx) < REL
    assert {n for n, g in grads.items() if g.abs().max() > 0} == want_grads.keys()
    assert any(".indexer." in n for n in want_grads)  # the KL reaches the indexer
    for name, want in want_grads.items():
        assert _rel(grads[name], want) < REL, name
    whole = REPORTED["whole"]
    assert [own.layer for own in whole] == [0]  # one indexer, layer 0's
    for metric in ("loss", "kl", "recall"):  # the mean over the ranks, as the step's metrics
        ranks_mean = torch.stack([_reported(r, metric) for r in range(sp)]).mean(0)
        assert _rel(ranks_mean, _reported("whole", metric)) < REL, metric
    recall = float(whole[0].metrics["recall"])
    assert 0 < recall < 1  # sparse: the indexer misses some of the keys dense attention wants


def _gathered_without_returning_gradients(ex, x_BsX: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """A wrong gather: every rank's keys, but the gradients that other ranks' queries give
    this rank's keys are dropped (an all-gather whose backward keeps the local part only)."""
    full = gather_sequence(ex, x_BsX.detach())
    s = x_BsX.shape[1]
    return torch.cat([full[:, : ex.rank * s], x_BsX, full[:, (ex.rank + 1) * s :]], 1)


@pytest.mark.parametrize("stage", ["sparse", pytest.param("dense_warmup", marks=pytest.mark.long)])
def test_the_keys_gradients_must_return_to_their_rank(monkeypatch, stage: str) -> None:
    """Control: with the keys' gradients from other ranks dropped, the key projections'
    gradients (the indexer's; in the sparse stage also the latent's) are far off."""
    stack, tables = _stack(stage)
    call = _caller(tables)
    x, probe = _inputs()
    _, _, want_grads = _whole(stack, call, x, probe)
    monkeypatch.setattr(sparse_latent, "gather_sequence", _gathered_without_returning_gradients)
    _, _, grads = run_sliced(stack, 2, x, probe, call)
    names = ["layers.0.indexer.wk.weight"]
    names += ["layers.0.wkv_a.weight"] if stage == "sparse" else []
    for name in names:
        assert _rel(grads[name], want_grads[name]) > 1e-3, name


def test_a_wrong_slice_order_is_caught() -> None:
    """Control: the ranks' slices handed in the wrong order differ far beyond the bound."""
    stack, tables = _stack("sparse")
    call = _caller(tables)
    x, probe = _inputs()
    want, _, _ = _whole(stack, call, x, probe)
    swapped = torch.cat([x[:, S // 2 :], x[:, : S // 2]], 1)
    out, _, _ = run_sliced(stack, 2, swapped, probe, call)
    assert _rel(torch.cat([out[:, S // 2 :], out[:, : S // 2]], 1), want) > 1e-3


@pytest.mark.parametrize("stage", ["sparse", pytest.param("dense_warmup", marks=pytest.mark.long)])
def test_plan_exchange_bytes_are_what_the_layers_send(stage: str) -> None:
    """``exchange_bytes_per_token`` of both layers (own indexer, shared) against what rank 0 of
    a pair hands its exchange in one training forward, ``(n - 1) / n`` of each send leaving the
    GPU: the keys gathered (sparse), or the dense exchange and the indexer's KL keys (warm-up)."""
    from tests.unit.test_plan import _ShapeExchange

    class Counting(_ShapeExchange):
        sent = 0

        def to_heads(self, x: torch.Tensor) -> torch.Tensor:
            Counting.sent += x.numel() * x.element_size() * (self.size - 1) / self.size
            return super().to_heads(x)

        def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
            Counting.sent += x.numel() * x.element_size() * (self.size - 1) / self.size
            return super().to_sequence(x)

    cfg = tiny_config(DSA, {"model.index_stage": stage, "parallel.sp_size": 2}).model
    stack, tables = _stack(stage)
    stack.float().set_head_exchange(Counting(2))
    x = torch.randn(B, S // 2, D)
    inputs = MixerInputs(*(t[: S // 2].float() for t in tables))
    for i, layer in enumerate(stack.layers):
        Counting.sent = 0
        layer(x, inputs)
        want = layer.exchange_bytes_per_token(cfg, mixer_spec(cfg, i), 4, 2) * B * S // 2
        assert Counting.sent == pytest.approx(want) and want > 0
