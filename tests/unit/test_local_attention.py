"""Sliding windows, chunked attention and attention sinks (model/local_attention.py) against an
explicit-mask softmax with the sink column: values and gradients, packed documents, the KV
cache, and the config rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config import ConfigError, ModelConfig
from moetrain.model import Transformer
from moetrain.model.doc_attention import Documents, document_attention
from moetrain.model.local_attention import (
    band_mask,
    cached_attention,
    chunk_segments,
    chunked_attention,
    local_attention,
)
from tests.helpers.configs import tiny_config
from tests.helpers.decoding import logits_through_cache


def reference(q, k, v, window, sinks, scale, allowed=None, chunk=None):
    """Explicit softmax over (scores | sink column) under the causal window mask (or the
    causal chunk mask: ``j // chunk == i // chunk``; and ``allowed``, (S, S) boolean, when
    given); q (B, H, n, Hd) are the last n of k's P."""
    b, h, n, _ = q.shape
    p = k.shape[2]
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    qpos, kpos = torch.arange(p - n, p)[:, None], torch.arange(p)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (kpos > qpos - window)
    if chunk is not None:
        mask = mask & (kpos // chunk == qpos // chunk)
    if allowed is not None:
        mask = mask & allowed
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    probs = scores.softmax(-1)
    return probs[..., :p] @ v


def _qkv(s: int, seed: int = 0, heads: int = 4, groups: int = 2):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(2, n, s, 16, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = make(heads), make(groups), make(groups)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, sinks)]


@pytest.mark.parametrize("window", [None, 1, 5, 8, 13, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("s", [8, 37])
def test_local_attention_matches_the_explicit_softmax(s, window, with_sinks) -> None:
    q, k, v, sinks = _qkv(s)
    sinks_H = sinks if with_sinks else None
    got = local_attention(q, k, v, window, sinks_H, enable_gqa=True, scale=0.3)
    ref = reference(q, k, v, window, sinks_H, 0.3)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(ref)
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    for a, b in zip(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    if with_sinks:  # the sinks change the output: they are not a no-op
        assert (got - local_attention(q, k, v, window, None, True, 0.3)).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("new", [1, 4])
def test_cached_attention_matches_the_explicit_softmax(window, new) -> None:
    q, k, v, sinks = _qkv(21, seed=1)
    got = cached_attention(q[:, :, -new:], k, v, window, sinks, True, 0.25)
    ref = reference(q[:, :, -new:], k, v, window, sinks, 0.25)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("chunk", [1, 5, 8, 13, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("s", [8, 37])
def test_chunked_attention_matches_the_explicit_softmax(s, chunk, with_sinks) -> None:
    q, k, v, sinks = _qkv(s, seed=3)
    sinks_H = sinks if with_sinks else None
    got = chunked_attention(q, k, v, chunk, sinks_H, enable_gqa=True, scale=0.3)
    ref = reference(q, k, v, None, sinks_H, 0.3, chunk=chunk)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(ref)
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    for a, b in zip(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    if chunk < s:  # the chunks bind: plain causal attention differs
        assert (got - local_attention(q, k, v, None, sinks_H, True, 0.3)).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [3, 6, 7, 30])
@pytest.mark.parametrize("new", [1, 4, 9])
def test_cached_chunked_attention_matches_the_explicit_softmax(chunk, new) -> None:
    """New queries against the cache, within one chunk or across chunk boundaries."""
    q, k, v, sinks = _qkv(21, seed=4)
    for sinks_H in (None, sinks):
        got = cached_attention(q[:, :, -new:], k, v, None, sinks_H, True, 0.25, chunk=chunk)
        ref = reference(q[:, :, -new:], k, v, None, sinks_H, 0.25, chunk=chunk)
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="not both"):
        cached_attention(q[:, :, -new:], k, v, 4, None, True, 0.25, chunk=chunk)


def test_chunk_segments_cut_documents_at_the_chunks() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5]])
    got = chunk_segments(doc_ids, 4)
    assert got.tolist() == [[1, 1, 1, 1, 2, 3, 3, 3, 4, 4], [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]]


@pytest.mark.parametrize("with_sinks", [False, True])
def test_documents_with_chunks_match_the_explicit_mask(with_sinks) -> None:
    """Packed documents in a chunked layer: a query sees its own document's part of its chunk
    (positions from the row's start), values and gradients."""
    q, k, v, sinks = _qkv(40, seed=5)
    doc_ids = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 30 + [1] * 10])
    sinks_H = sinks if with_sinks else None
    docs = Documents.from_ids(chunk_segments(doc_ids, 6))
    got = document_attention(q, k, v, docs, True, 0.3, None, sinks_H)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, S, S)
    refs = [
        reference(q[r : r + 1], k[r : r + 1], v[r : r + 1], None, sinks_H, 0.3, same[r], chunk=6)
        for r in range(2)
    ]
    ref = torch.cat(refs)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(ref)
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    for a, b in zip(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_band_mask_is_the_window_rule() -> None:
    w = 4
    mask = band_mask(w, sink=False, device=torch.device("cpu"))
    # chunk c's queries cW + a, keys cW - W + 1 + j
    for a in range(w):
        for j in range(2 * w - 1):
            q, key = w + a, 1 + j
            assert bool(mask[a, j]) == (q - w < key <= q)
    assert band_mask(w, sink=True, device=torch.device("cpu"))[:, 0].all()


@pytest.mark.parametrize("with_sinks", [False, True])
def test_documents_with_windows_match_the_explicit_mask(with_sinks) -> None:
    q, k, v, sinks = _qkv(40, seed=2)
    doc_ids = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 30 + [1] * 10])
    sinks_H = sinks if with_sinks else None
    got = document_attention(q, k, v, Documents.from_ids(doc_ids), True, 0.3, 5, sinks_H)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, S, S)
    for row in range(2):
        ref = reference(
            q[row : row + 1], k[row : row + 1], v[row : row + 1], 5, sinks_H, 0.3, same[row]
        )
        torch.testing.assert_close(got[row : row + 1], ref, atol=1e-12, rtol=1e-10)


def _windowed(**extra) -> ModelConfig:
    base = {
        "model.sliding_window": 4,
        "model.layer_types": ["sliding_attention", "full_attention"],
        "model.attention_sinks": True,
        "model.o_bias": True,
        "model.n_layers": 2,
    }
    return tiny_config({**base, **extra})


def test_model_layers_take_their_windows_and_the_cache_is_exact() -> None:
    cfg = _windowed()
    assert [cfg.model.attention_window(i) for i in range(2)] == [4, None]
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", ".bias")):
                p.uniform_(-1, 1)
    assert model.layers[0].attn.window == 4 and model.layers[1].attn.window is None
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = model(ids).logits
        cached = logits_through_cache(model, ids, 9, 5)
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
        # the window binds: a full-attention model with the same weights differs
        plain_cfg = dataclasses.replace(cfg.model, sliding_window=None, layer_types=None)
        plain = Transformer(plain_cfg, cfg.moe).eval()
        plain.load_state_dict(model.state_dict())
        assert (plain(ids).logits - full).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"model.sliding_window": 512}, "model.sliding_window"),  # not shorter than the context
        ({"model.layer_types": ["sliding_attention", "local"]}, "model.layer_types"),
        ({"model.layer_types": ["full_attention"]}, "model.layer_types"),
        ({"model.sliding_window": None}, "model.sliding_window"),
    ],
)
def test_window_rules_are_refused_by_key(extra, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _windowed(**{"model.max_seq_len": 512, **extra})


def _chunked(**extra) -> ModelConfig:
    base = {
        "model.attention_chunk_size": 5,
        "model.layer_types": ["chunked_attention", "full_attention"],
        "model.n_layers": 2,
    }
    return tiny_config({**base, **extra})


def test_model_layers_take_their_chunks_with_documents_and_the_cache() -> None:
    """A chunked and a full layer: the KV cache's logits equal the full forward's across chunk
    boundaries, and one document per row equals no document mask."""
    cfg = _chunked()
    assert [cfg.model.attention_chunk(i) for i in range(2)] == [5, None]
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    assert model.layers[0].attn.chunk == 5 and model.layers[1].attn.chunk is None
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = model(ids).logits
        cached = logits_through_cache(model, ids, 9, 5)
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
        one_doc = model(ids, doc_ids_BS=torch.zeros_like(ids)).logits
        torch.testing.assert_close(one_doc, full, atol=1e-5, rtol=1e-5)
        # the chunks bind: a full-attention model with the same weights differs
        plain_cfg = dataclasses.replace(cfg.model, attention_chunk_size=None, layer_types=None)
        plain = Transformer(plain_cfg, cfg.moe).eval()
        plain.load_state_dict(model.state_dict())
        assert (plain(ids).logits - full).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"model.attention_chunk_size": 512}, "model.attention_chunk_size"),
        ({"model.attention_chunk_size": None}, "model.attention_chunk_size"),
        ({"model.layer_types": ["chunked_attention", "local"]}, "model.layer_types"),
        ({"model.sliding_window": 4, "model.layer_types": None}, "model.layer_types"),
        ({"model.attention": "mla"}, "model.attention_chunk_size"),
    ],
)
def test_chunk_rules_are_refused_by_key(extra, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _chunked(**{"model.max_seq_len": 512, **extra})
