"""The compressed-attention kernel (``model/compressed_kernel.py``) against a written-out dense
fp64 reference: values and the gradients of the queries, keys, entries and sinks, at fp32
rounding, for every kind of entries (none, every closed one, a selection with invalid picks),
in blocks shorter than the window (a block's keys span several blocks, the last block short)."""

from __future__ import annotations

import pytest
import torch

from moetrain.model import compressed_kernel
from moetrain.model.compressed_kernel import window_entry_attention, window_entry_logit_max

B, S, H, K, WIN, RATE, TOPK = 2, 37, 3, 8, 6, 4, 5


def inputs(kind: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    q, kv = torch.randn(B, S, H, K, generator=gen), torch.randn(B, S, K, generator=gen)
    n = {"sliding": 0, "hca": S // RATE, "csa": S // RATE}[kind]
    entries = torch.randn(B, n, K, generator=gen)
    sinks = torch.randn(H, generator=gen) * 3  # (a head far above and one far below its logits)
    picks = None
    if kind == "csa":  # a query's picks: random entries, the ones not yet closed invalid
        idx = torch.rand(B, S, n, generator=gen).argsort(-1)[..., :TOPK]
        picks = (idx, idx < ((torch.arange(S) + 1) // RATE)[:, None])
    return q, kv, entries, picks, sinks


def dense_fp64(q, kv, entries, picks, sinks, scale: float) -> torch.Tensor:  # noqa: ANN001
    """Every query against every key and entry in fp64, masked: the window, then the entries
    the query sees (its valid picks, or every closed one), then the sink's logit."""
    pos = torch.arange(S)
    lag = pos[:, None] - pos[None, :]
    seen = ((lag >= 0) & (lag < WIN)).expand(B, S, S)
    n = entries.shape[1]
    if picks is None:
        seen_entries = (torch.arange(n) < ((pos + 1) // RATE)[:, None]).expand(B, S, n)
    else:
        seen_entries = torch.zeros(B, S, n, dtype=torch.bool).scatter_(-1, *picks)
    keys = torch.cat((kv, entries), dim=1).double()
    logits = torch.einsum("bshk,btk->bsht", q.double(), keys) * scale
    logits = logits.masked_fill(~torch.cat((seen, seen_entries), -1)[:, :, None], float("-inf"))
    sink = sinks.double().view(1, 1, H, 1).expand(B, S, H, 1)
    p = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bsht,btk->bshk", p, keys)


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_matches_a_dense_fp64_reference(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compressed_kernel, "BLOCK", 4)
    q, kv, entries, picks, sinks = inputs(kind)
    rate, scale = (RATE if kind != "sliding" else 1), K**-0.5
    leaves = [t.clone().requires_grad_(True) for t in (q, kv, entries, sinks)]
    refs = [t.double().requires_grad_(True) for t in (q, kv, entries, sinks)]
    got = window_entry_attention(*leaves[:3], picks, leaves[3], WIN, rate, scale)
    want = dense_fp64(*refs[:3], picks, refs[3], scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
    got.backward(g)
    want.backward(g.double())
    for name, leaf, ref in zip(("q", "kv", "entries", "sinks"), leaves, refs, strict=True):
        if ref.numel():
            torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    if kind == "csa":  # negative control: the reference with one valid pick dropped differs
        fewer = picks[1].clone()
        fewer[0, -1, picks[1][0, -1].nonzero()[0]] = False
        other = dense_fp64(*(r.detach() for r in refs[:3]), (picks[0], fewer), refs[3], scale)
        assert not torch.allclose(got.double(), other, rtol=1e-4, atol=1e-4)


def test_logit_maxima_are_the_dense_logits_seen() -> None:
    q, kv, entries, picks, _ = inputs("csa")
    scale = K**-0.5
    got = window_entry_logit_max(q, kv, entries, picks, WIN, RATE, scale)
    pos = torch.arange(S)
    lag = pos[:, None] - pos[None, :]
    seen_entries = torch.zeros(B, S, entries.shape[1], dtype=torch.bool).scatter_(-1, *picks)
    seen = torch.cat((((lag >= 0) & (lag < WIN)).expand(B, S, S), seen_entries), dim=-1)
    logits = torch.einsum("bshk,btk->bsht", q, torch.cat((kv, entries), 1)) * scale
    want = logits.masked_fill(~seen[:, :, None], float("-inf")).amax(dim=(0, 1, 3))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
