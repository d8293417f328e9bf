"""Chunked linear + cross-entropy: same loss and gradients as F.cross_entropy on full logits,
with less memory saved for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.model import Transformer
from moetrain.model.loss import chunked_cross_entropy
from tests.helpers.configs import tiny_config

N, D, V = 37, 16, 50


def inputs(dtype: torch.dtype = torch.float32, ignore_every: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return h, w, labels


def plain(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)


def loss_and_grads(fn, h, w, labels, scale: float = 0.7):
    h.grad = w.grad = None
    loss = fn(h, w, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 5, 8, 36, 37, 1024])
def test_fp32_matches_full_logits_for_any_chunk_size(chunk: int) -> None:
    h, w, labels = inputs()
    ref = loss_and_grads(plain, h, w, labels)
    got = loss_and_grads(lambda *a: chunked_cross_entropy(*a, chunk), h, w, labels)
    for r, g in zip(ref, got, strict=True):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 8, 1024])
def test_a_bias_matches_full_logits_with_its_gradient(chunk: int) -> None:
    h, w, labels = inputs()
    b = (torch.randn(V, generator=torch.Generator().manual_seed(3)) * 0.5).requires_grad_()

    def run(fn):
        h.grad = w.grad = b.grad = None
        (fn() * 0.7).backward()
        return h.grad, w.grad, b.grad

    ref = run(lambda: F.cross_entropy(F.linear(h, w, b), labels, ignore_index=-100))
    got = run(lambda: chunked_cross_entropy(h, w, labels, chunk, b))
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    assert b.grad.abs().max() > 1e-3


def test_bf16_matches_full_logits_within_bf16_rounding() -> None:
    h, w, labels = inputs(torch.bfloat16)
    ref = loss_and_grads(plain, h, w, labels)
    got = loss_and_grads(lambda *a: chunked_cross_entropy(*a, 8), h, w, labels)
    assert got[0].dtype == torch.float32
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # same bf16 logits
    for r, g in zip(ref[1:], got[1:], strict=True):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-3)


def test_all_ignored_and_empty_give_zero_loss_and_zero_grads() -> None:
    h, w, labels = inputs(ignore_every=1)
    loss, gh, gw = loss_and_grads(lambda *a: chunked_cross_entropy(*a, 8), h, w, labels)
    assert loss.item() == 0.0
    assert torch.all(gh == 0) and torch.all(gw == 0)
    empty = torch.zeros(0, D, requires_grad=True)
    loss, gh, gw = loss_and_grads(
        lambda *a: chunked_cross_entropy(*a, 8), empty, w, labels[:0].clone()
    )
    assert loss.item() == 0.0 and gh.shape == (0, D) and torch.all(gw == 0)


def test_only_inputs_that_require_grad_get_one() -> None:
    h, w, labels = inputs()
    _, gh_ref, gw_ref = loss_and_grads(plain, h, w, labels, scale=1.0)
    frozen_w = w.detach()
    chunked_cross_entropy(h, frozen_w, labels, 8).backward()
    torch.testing.assert_close(h.grad, gh_ref, rtol=1e-6, atol=1e-6)
    fixed_h = h.detach()
    chunked_cross_entropy(fixed_h, w, labels, 8).backward()
    torch.testing.assert_close(w.grad, gw_ref, rtol=1e-6, atol=1e-6)


def test_without_autograd_only_the_loss_is_computed() -> None:
    h, w, labels = inputs()
    with torch.no_grad():
        loss = chunked_cross_entropy(h, w, labels, 8)
        torch.testing.assert_close(loss, plain(h, w, labels), rtol=1e-6, atol=1e-6)
    assert not loss.requires_grad


def test_tied_weight_accumulates_the_embedding_and_head_gradients() -> None:
    h, w, labels = inputs()
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))

    def tied(fn):
        w.grad = None
        x = F.embedding(ids, w) + h  # the weight used twice: embedding and head
        fn(x, w, labels).backward()
        return w.grad

    torch.testing.assert_close(
        tied(lambda *a: chunked_cross_entropy(*a, 5)), tied(plain), rtol=1e-6, atol=1e-6
    )


def test_bad_inputs_are_clear_errors() -> None:
    h, w, labels = inputs()
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_cross_entropy(h, w, labels, 0)
    with pytest.raises(ValueError, match="dtypes differ"):
        chunked_cross_entropy(h, w.bfloat16(), labels, 8)
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(h, w, labels[:-1], 8)


def saved_bytes(fn, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages, other than ``inputs``, that autograd saves for backward
    while ``fn`` runs."""
    owned = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in owned:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_saves_gradients_instead_of_logits() -> None:
    n, d, v = 512, 16, 4096
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    full = saved_bytes(lambda: plain(h, w, labels), h, w)
    chunked = saved_bytes(lambda: chunked_cross_entropy(h, w, labels, 64), h, w)
    assert full >= n * v * 4  # the fp32 log-softmax
    assert chunked <= 4 * (n * d + v * d) + 64  # grad wrt h, fp32 grad wrt W, the count


def tiny_model(tie: bool, chunk: int, head_bias: bool = False) -> Transformer:
    torch.manual_seed(0)
    cfg = tiny_config(
        model__max_seq_len=32,
        model__tie_embeddings=tie,
        model__loss_chunk_tokens=chunk,
        model__lm_head_bias=head_bias,
        model__logits_scaling=3.0 if head_bias else 1.0,
    )
    return Transformer(cfg.model, cfg.moe)


@pytest.mark.parametrize(("tie", "head_bias"), [(False, False), (True, False), (True, True)])
def test_transformer_loss_and_grads_match_with_chunking_on_and_off(tie, head_bias) -> None:
    """Chunked or not, the same loss and gradients (with a head bias too, which stays the
    head's own when the weight is tied, and with logits_scaling, which divides it)."""
    ids = torch.randint(0, 64, (3, 12))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    runs = {}
    for chunk in (0, 7):
        model = tiny_model(tie, chunk, head_bias)
        if head_bias:
            assert model.lm_head.bias is not None and model.lm_head.weight is model.embed.weight
            with torch.no_grad():
                model.lm_head.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
        out = model(ids, labels_BS=labels, return_logits=False)
        assert (out.logits is None) == (chunk > 0)
        out.loss.backward()
        runs[chunk] = (out.ce_loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss_off, grads_off), (loss_on, grads_on) = runs[0], runs[7]
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_transformer_loss_is_zero_not_nan_when_every_label_is_ignored() -> None:
    ids = torch.randint(0, 64, (2, 8))
    labels = torch.full_like(ids, -100)
    for chunk in (0, 4):
        model = tiny_model(False, chunk)
        for return_logits in (False, True):
            out = model(ids, labels_BS=labels, return_logits=return_logits)
            assert out.ce_loss.item() == 0.0, (chunk, return_logits)
            out.loss.backward()
            assert all(
                torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
            )


def test_transformer_returns_logits_unless_told_not_to() -> None:
    model = tiny_model(False, 4)
    ids = torch.randint(0, 64, (2, 8))
    assert model(ids, labels_BS=ids).logits.shape == (2, 8, 64)
    assert model(ids, return_logits=False).logits.shape == (2, 8, 64)  # no labels: no loss
