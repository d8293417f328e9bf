"""Attention over each query's selected keys (DeepSeek sparse attention), in latent attention's
shared-key ("absorbed") form, a block of queries at a time: no (S, S) tensor, no (S, k, H)
keys.

Shape legend: B batch, S queries, T key positions, H heads, K = C + R (the KV latent and the
rotary key), C the latent, k selected keys per query, q a block of queries.

Every head of latent attention scores its query against the same per-token key
``[latent_C | k_rope_R]`` once its non-rotary query is multiplied by its slice of ``wkv_b``
(``q_abs = q_nope @ W_UK``), and its output is the latent weighted by the probabilities,
``o_C``, multiplied by its value slice ``W_UV`` afterwards (the caller does both): so each
query's selected keys are gathered once, ``k * K`` values, whatever the number of heads.
Softmax in fp32; the backward pass gathers each block's keys again and adds their gradients
into the keys' rows (flash attention's recomputation, with the saved log-sum-exp).
"""

from __future__ import annotations

import torch

from moetrain.model.sparse_index import add_rows, gather_blocks, gather_rows


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _probs(q_BqHK, kv_Bqk, valid, scale, lse=None):  # noqa: ANN001, ANN202
    """fp32 softmax probabilities (B, q, H, k) over the valid selected keys, and the
    log-sum-exp (B, q, H) they were normalised by (``lse``: reuse it)."""
    s_BqHk = wide(torch.matmul(q_BqHK, kv_Bqk.transpose(-1, -2))).mul_(scale)
    s_BqHk.masked_fill_(~valid.unsqueeze(2), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s_BqHk, dim=-1)
    return s_BqHk.sub_(lse.unsqueeze(-1)).exp_(), lse


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, valid, scale, latent, want_probs):  # noqa: ANN001, ANN205
        b, s, h, width = q.shape
        out = q.new_empty(b, s, h, latent)
        acc = torch.promote_types(q.dtype, torch.float32)
        lse = q.new_empty(b, s, h, dtype=acc)
        probs = q.new_zeros(b, s, idx.shape[-1], dtype=acc) if want_probs else None
        blocks = gather_blocks(s, b * idx.shape[-1] * (width + 2 * h))  # keys and scores
        for i0, i1 in blocks:
            kv_sel = gather_rows(kv, idx[:, i0:i1])  # (B, q, k, K)
            p, lse[:, i0:i1] = _probs(q[:, i0:i1], kv_sel, valid[:, i0:i1], scale)
            out[:, i0:i1] = torch.matmul(p.to(q.dtype), kv_sel[..., :latent])
            if want_probs:
                probs[:, i0:i1] = p.mean(2)
        ctx.blocks, ctx.scale, ctx.latent = blocks, scale, latent
        ctx.save_for_backward(q, kv, idx, valid, out, lse)
        if not want_probs:
            return out, out.new_empty(0)
        ctx.mark_non_differentiable(probs)
        return out, probs

    @staticmethod
    def backward(ctx, g_out, _g_probs):  # noqa: ANN001, ANN205
        q, kv, idx, valid, out, lse = ctx.saved_tensors
        c = ctx.latent
        grad_q = torch.empty_like(q)
        grad_kv = torch.zeros_like(kv, dtype=torch.promote_types(kv.dtype, torch.float32))
        for i0, i1 in ctx.blocks:
            kv_sel = gather_rows(kv, idx[:, i0:i1])
            p, _ = _probs(q[:, i0:i1], kv_sel, valid[:, i0:i1], ctx.scale, lse[:, i0:i1])
            g = g_out[:, i0:i1]  # (B, q, H, C)
            dp = wide(torch.matmul(g, kv_sel[..., :c].transpose(-1, -2)))
            delta = (wide(g) * wide(out[:, i0:i1])).sum(-1, keepdim=True)
            ds = p * (dp - delta) * ctx.scale  # (B, q, H, k)
            grad_q[:, i0:i1] = torch.matmul(ds.to(q.dtype), kv_sel)
            dkv = torch.matmul(ds.transpose(-1, -2), wide(q[:, i0:i1]))  # (B, q, k, K)
            dkv[..., :c] += torch.matmul(p.transpose(-1, -2), wide(g))
            add_rows(grad_kv, idx[:, i0:i1], dkv)
        return grad_q, grad_kv.to(kv.dtype), None, None, None, None, None


def sparse_latent_attention(
    q_BSHK: torch.Tensor,
    kv_BTK: torch.Tensor,
    idx_BSk: torch.Tensor,
    valid_BSk: torch.Tensor,
    scale: float,
    latent: int,
    want_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each query's attention over its selected keys: ``q`` (B, S, H, K) the absorbed queries
    with their rotary dims, ``kv`` (B, T, K) every position's ``[latent | k_rope]``, ``idx`` /
    ``valid`` (B, S, k) the selected positions and which of them count, ``scale`` the softmax
    scale, ``latent`` = C (the values are the keys' first C dims). Returns the latent outputs
    (B, S, H, C) and, with ``want_probs``, the heads' mean probabilities over the selected
    keys (B, S, k) fp32, without gradient (the indexer's sparse target)."""
    out, probs = _SparseAttention.apply(
        q_BSHK, kv_BTK, idx_BSk, valid_BSk, scale, latent, want_probs
    )
    return out, probs if want_probs else None
