"""DeepSeek sparse attention's blockwise arithmetic (``model/sparse_index.py``,
``model/sparse_attention.py``) against dense references that build the (S, S) tensors: the
selection, attention over the selected keys, the indexer's scores there and its KL losses,
values and gradients, with blocks small enough that every function runs several."""

from __future__ import annotations

import pytest
import torch

from moetrain.model import sparse_index
from moetrain.model.sparse_attention import sparse_latent_attention
from moetrain.model.sparse_index import (
    causal_keys,
    dense_index_kl,
    document_keys,
    index_scores_at,
    select_keys,
    selected_kl,
    top_k_recall,
)

B, S, HI, DI, H, C, R = 2, 40, 4, 8, 4, 12, 4
DOCS = torch.tensor([[0] * 17 + [1] * 3 + [2] * 20, [5] * 40])


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few queries per block, so every loop runs many blocks."""
    monkeypatch.setattr(sparse_index, "BLOCK_VALUES", 2000)


def _keys(docs: bool):  # noqa: ANN202
    return document_keys(DOCS) if docs else causal_keys(B, S, 0, torch.device("cpu"))


def _allowed(docs: bool) -> torch.Tensor:
    """(B, S, S): query t may see key j."""
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    if not docs:
        return causal.expand(B, S, S)
    return causal & (DOCS[:, :, None] == DOCS[:, None, :])


def _indexer(dtype: torch.dtype = torch.float64, seed: int = 0):  # noqa: ANN202
    """Indexer queries, weights and keys whose scores have no ties (a score is 0 where every
    head's product is negative: positive weights and mostly positive products keep those out
    of each top-k), some products negative (the relu's gradient)."""
    g = torch.Generator().manual_seed(seed)
    qi = torch.randn(B, S, HI, DI, generator=g, dtype=dtype) + 0.5
    w = torch.rand(B, S, HI, generator=g, dtype=dtype) + 0.1
    ki = torch.randn(B, S, DI, generator=g, dtype=dtype) + 0.5
    return qi, w, ki


def _dense_scores(qi, w, ki):  # noqa: ANN001, ANN202
    return torch.einsum("bth,bthj->btj", w, torch.einsum("bthd,bjd->bthj", qi, ki).relu())


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("topk", [5, 64])
def test_selection_is_the_top_k_of_the_dense_masked_scores(docs: bool, topk: int) -> None:
    qi, w, ki = _indexer()
    allowed = _allowed(docs)
    dense = _dense_scores(qi, w, ki).masked_fill(~allowed, float("-inf"))
    idx, valid = select_keys(qi, w, ki, _keys(docs), topk)
    assert idx.shape == (B, S, topk)
    for b in range(B):
        for t in range(S):
            n = int(allowed[b, t].sum())
            want = set(dense[b, t].topk(min(topk, n)).indices.tolist())
            assert set(idx[b, t][valid[b, t]].tolist()) == want
            assert int(valid[b, t].sum()) == min(topk, n)


@pytest.mark.parametrize("docs", [False, True])
def test_ties_at_the_kth_score_keep_the_earliest_keys_whatever_the_block(docs: bool) -> None:
    """Every other key's index vector is zero (its score exactly 0), the others' products all
    negative for some queries: many queries tie at the k-th score. Each keeps the k best keys,
    ties broken by the earliest position (a stable descending sort of the dense scores), and
    the later queries alone (a sequence-parallel rank's, over the whole rows' keys) select the
    same keys as the whole rows do; torch's own topk keeps other keys of the ties (caught)."""
    qi, w, ki = _indexer()
    ki[:, ::2] = 0.0
    qi[:, ::3] = -qi[:, ::3].abs()  # every product <= 0: every visible key ties at 0
    ki[:, 1::2] = ki[:, 1::2].abs()
    keys, topk, allowed = _keys(docs), 5, _allowed(docs)
    dense = _dense_scores(qi, w, ki).masked_fill(~allowed, float("-inf"))
    idx, valid = select_keys(qi, w, ki, keys, topk)
    late, late_valid = select_keys(qi[:, 23:], w[:, 23:], ki, keys.rows(23, S), topk)
    assert torch.equal(late, idx[:, 23:]) and torch.equal(late_valid, valid[:, 23:])
    order = torch.sort(dense, dim=-1, descending=True, stable=True).indices
    ties = differs = 0
    for b in range(B):
        for t in range(S):
            n = min(topk, int(allowed[b, t].sum()))
            assert set(idx[b, t][valid[b, t]].tolist()) == set(order[b, t, :n].tolist())
            if n == topk and int((dense[b, t] >= dense[b, t, order[b, t, n - 1]]).sum()) > n:
                ties += 1
                differs += set(dense[b, t].topk(n).indices.tolist()) != set(
                    order[b, t, :n].tolist()
                )
    assert ties > 10 and differs > 0


def test_a_rows_selection_in_order_does_not_depend_on_the_rows_beside_it() -> None:
    """A tie-free row selects the same keys in the same order (positions ascending) beside a
    row whose queries tie at the k-th score as alone (the order is the order in which its
    attention and KL add the selected keys up: a batch split otherwise rounds them
    differently, as a data-parallel layout's is)."""
    qi, w, ki = _indexer()
    ki[0, ::2] = 0.0
    qi[0, ::3] = -qi[0, ::3].abs()  # row 0: many queries tie at their k-th score (0)
    cpu = torch.device("cpu")
    idx, valid = select_keys(qi, w, ki, causal_keys(B, S, 0, cpu), 5)
    alone, alone_valid = select_keys(qi[1:], w[1:], ki[1:], causal_keys(1, S, 0, cpu), 5)
    assert torch.equal(idx[1:], alone) and torch.equal(valid[1:], alone_valid)
    assert bool((idx[:, 5:].diff(dim=-1) > 0).all())  # (queries that see 5 keys or more)


def _attention_inputs(dtype: torch.dtype):  # noqa: ANN202
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, H, C + R, generator=g, dtype=dtype, requires_grad=True)
    kv = torch.randn(B, S, C + R, generator=g, dtype=dtype, requires_grad=True)
    return q, kv


@pytest.mark.parametrize("docs", [False, True])
def test_block_attention_equals_a_dense_masked_reference_on_the_selected_keys(docs: bool) -> None:
    qi, w, ki = _indexer()
    idx, valid = select_keys(qi, w, ki, _keys(docs), 7)
    chosen = torch.zeros(B, S, S, dtype=torch.uint8)
    chosen = chosen.scatter_reduce_(-1, idx, valid.to(torch.uint8), "amax").bool()
    assert chosen.sum(-1).max() == 7 and (chosen & ~_allowed(docs)).sum() == 0
    q, kv = _attention_inputs(torch.float64)
    out, probs = sparse_latent_attention(q, kv, idx, valid, 0.3, C, want_probs=True)
    scores = torch.einsum("bthk,bjk->bthj", q, kv) * 0.3
    p_ref = torch.softmax(scores.masked_fill(~chosen[:, :, None], float("-inf")), -1)
    ref = torch.einsum("bthj,bjc->bthc", p_ref, kv[..., :C])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(probs, p_ref.mean(2).gather(-1, idx) * valid)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, kv), g)
    ref_grads = torch.autograd.grad(ref, (q, kv), g)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_block_attention_in_bf16_is_close_to_fp32() -> None:
    qi, w, ki = _indexer(torch.float32)
    idx, valid = select_keys(qi, w, ki, _keys(True), 7)
    q, kv = _attention_inputs(torch.float32)
    out, _ = sparse_latent_attention(q, kv, idx, valid, 0.3, C)
    half, _ = sparse_latent_attention(q.bfloat16(), kv.bfloat16(), idx, valid, 0.3, C)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), out, atol=3e-2, rtol=3e-2)
    half.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_scores_at_the_selected_keys_and_their_gradients() -> None:
    qi, w, ki = (t.requires_grad_() for t in _indexer())
    idx, valid = select_keys(qi, w, ki, _keys(True), 6)
    got = index_scores_at(qi, w, ki, idx)
    ref = _dense_scores(qi, w, ki).gather(-1, idx)
    torch.testing.assert_close(got, ref)
    g = torch.randn_like(got) * valid
    for a, b in zip(
        torch.autograd.grad(got, (qi, w, ki), g),
        torch.autograd.grad(ref, (qi, w, ki), g),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def _dense_target(docs: bool):  # noqa: ANN202
    """The main attention's heads' mean distribution (B, S, S) and its inputs."""
    q, kv = (t.detach() for t in _attention_inputs(torch.float64))
    scores = torch.einsum("bthk,bjk->bthj", q, kv) * 0.3
    p = torch.softmax(scores.masked_fill(~_allowed(docs)[:, :, None], float("-inf")), -1)
    return p.mean(2), q, kv


@pytest.mark.parametrize("docs", [False, True])
def test_dense_kl_equals_the_kl_of_the_whole_distributions(docs: bool) -> None:
    qi, w, ki = (t.requires_grad_() for t in _indexer())
    p, q, kv = _dense_target(docs)
    got = dense_index_kl(qi, w, ki, q, kv, 0.3, _keys(docs))
    scores = _dense_scores(qi, w, ki).masked_fill(~_allowed(docs), float("-inf"))
    log_q = torch.log_softmax(scores, -1)
    ref = (torch.xlogy(p, p) - torch.where(_allowed(docs), p * log_q, 0.0)).sum(-1)
    torch.testing.assert_close(got, ref)
    assert (got >= -1e-12).all()
    g = torch.rand_like(got)
    for a, b in zip(
        torch.autograd.grad(got, (qi, w, ki), g),
        torch.autograd.grad(ref, (qi, w, ki), g),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def test_selected_kl_is_zero_only_for_equal_distributions() -> None:
    valid = torch.tensor([[[True, True, True, False]]])
    scores = torch.tensor([[[0.5, -1.0, 2.0, 7.0]]], dtype=torch.float64)
    same = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
    assert float(selected_kl(same, scores, valid)) == pytest.approx(0.0, abs=1e-12)
    other = torch.tensor([[[0.2, 0.3, 0.5, 0.0]]], dtype=torch.float64)
    want = sum(
        float(a) * (torch.log(a) - torch.log(b))
        for a, b in zip(other[0, 0, :3], same[0, 0, :3], strict=True)
    )
    assert float(selected_kl(other, scores, valid)) == pytest.approx(want)


@pytest.mark.parametrize("docs", [False, True])
def test_recall_counts_the_dense_top_k_that_the_selection_holds(docs: bool) -> None:
    qi, w, ki = _indexer()
    p, q, kv = _dense_target(docs)
    keys, topk = _keys(docs), 5
    idx, valid = select_keys(qi, w, ki, keys, topk)
    got = float(top_k_recall(idx, valid, q, kv, 0.3, keys))
    hits = total = 0
    for b in range(B):
        for t in range(S):
            n = min(topk, int(_allowed(docs)[b, t].sum()))
            dense = set(p[b, t].topk(n).indices.tolist())
            hits += len(dense & set(idx[b, t][valid[b, t]].tolist()))
            total += n
    assert got == pytest.approx(hits / total)
    assert 0 < got < 1
    ideal = p.masked_fill(~_allowed(docs), -1.0).topk(topk, -1)
    assert float(top_k_recall(ideal.indices, ideal.values >= 0, q, kv, 0.3, keys)) == 1.0
