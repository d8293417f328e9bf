"""Document-masked attention without an S x S mask (model/doc_attention.py) against the dense
block-causal mask: outputs and gradients, for many short documents, one long document,
documents cut by row boundaries, and grouped K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.attention import document_mask
from moetrain.model.doc_attention import MIN_BUCKET, Documents, document_attention


def _ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row]
    return torch.stack(rows)


def _case(ids: torch.Tensor, heads: int, kv_heads: int, hd: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, s = ids.shape
    q = torch.randn(b, heads, s, hd, generator=g, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(b, kv_heads, s, hd, generator=g, dtype=torch.float64).requires_grad_(True)
    v = torch.randn(b, kv_heads, s, hd, generator=g, dtype=torch.float64).requires_grad_(True)
    return q, k, v


LAYOUTS = {
    "many short": [[3, 1, 7, 2, 30, 5, 12, 4], [1] * 8 + [56]],
    "one document": [[64], [64]],
    "cut by rows": [[40, 24], [10, 50, 4]],  # each row starts inside a document of the last
    "bucket edges": [[16, 17, 31], [MIN_BUCKET - 1, 1, 32, 16]],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_equals_the_dense_document_mask(layout: str, kv_heads: int) -> None:
    ids = _ids(LAYOUTS[layout])
    q, k, v = _case(ids, 4, kv_heads)
    gqa = kv_heads != 4
    got = document_attention(q, k, v, Documents.from_ids(ids), enable_gqa=gqa)
    grad = torch.randn_like(got)
    (dq, dk, dv) = torch.autograd.grad(got, (q, k, v), grad)
    mask = document_mask(ids)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    (wq, wk, wv) = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in ((got, want), (dq, wq), (dk, wk), (dv, wv)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_few_kernel_calls_and_nothing_quadratic() -> None:
    """Documents share one call per power-of-two bucket; no tensor has S x S elements."""
    ids = _ids([[1, 2, 3, 5, 8, 13, 21, 34, 41] * 4])  # 36 documents, S = 512
    docs = Documents.from_ids(ids)
    assert len(docs.buckets) == 3  # 16, 32, 64
    assert sum(int(r.sum()) for _, r in docs.buckets) == ids.numel()  # each token once
    s = ids.shape[1]
    assert all(i.numel() < s * s // 4 for i, _ in docs.buckets)
