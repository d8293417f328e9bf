"""The lightning indexer's arithmetic (DeepSeek sparse attention, DeepSeek-V3.2): which keys each
query attends to, the indexer's KL losses and its recall, computed a block of queries at a time
so that no (S, S) tensor exists at once.

Shape legend: B batch, S queries, T key positions, W keys one block of queries may see, Hi
indexer heads, Di its head dim, k the keys each query keeps (``model.index_topk``), H the main
attention's heads, K the dims of its (absorbed) query and shared key, q a block of queries.

The index score of query t and key j is ``I[t, j] = sum_h w[t, h] * relu(qi[t, h] . ki[j])``
(``w`` carries the indexer's scales). Query t may see key j where ``start[t] <= j <= pos[t]``:
``pos`` its position in the row, ``start`` its document's first position (0 without packed
documents). Each query keeps the ``k`` keys it may see with the highest scores (all of them
while there are fewer: the other entries are marked invalid). Memory: one block of queries
computes its scores over the keys it may see, ``B * q * Hi * W`` values at a time, with ``q``
chosen to keep that within :data:`BLOCK_VALUES`; the selection itself is ``B * S * k``.

The indexer trains on the KL divergence from the main attention's distribution over the keys
(each head's softmax, summed over heads and normalised, i.e. their mean) to the softmax of its
scores: over every key a query may see in the dense warm-up (:func:`dense_index_kl`), over the
selected keys in sparse training (:func:`index_scores_at` gives the scores there). Both
backward passes recompute a block at a time.
"""

from __future__ import annotations

import torch

BLOCK_VALUES = 1 << 20  # values one block's largest intermediate may hold (4 MiB in fp32)


class Keys:
    """Which keys each of ``S`` queries may see: ``pos`` (S,) its positions (increasing),
    ``start_BS`` (B, S) its documents' first positions."""

    def __init__(self, pos: torch.Tensor, start_BS: torch.Tensor) -> None:
        self.pos, self.start_BS = pos, start_BS

    def rows(self, i0: int, i1: int) -> Keys:
        """Queries ``[i0, i1)`` of these."""
        return Keys(self.pos[i0:i1], self.start_BS[:, i0:i1])

    def wanted(self, topk: int) -> torch.Tensor:
        """How many keys dense attention's top-k holds over these queries: ``min(topk, keys a
        query may see)`` summed (int64 scalar)."""
        return (self.pos[None] - self.start_BS + 1).clamp_(max=topk).sum()

    def blocks(self, width: int) -> list[tuple[int, int, int, int]]:
        """``(i0, i1, lo, hi)``: query blocks ``[i0, i1)`` whose keys lie in ``[lo, hi)``,
        ``(i1 - i0) * width * (hi - lo) <= BLOCK_VALUES`` where one block allows it (``width``:
        the values per query and key)."""
        s, out = self.pos.shape[0], []
        span = int(self.pos[-1]) + 1 - int(self.start_BS.min())
        q = max(1, BLOCK_VALUES // max(1, width * span))
        starts = self.start_BS.min(0).values.tolist()
        pos = self.pos.tolist()
        for i0 in range(0, s, q):
            i1 = min(s, i0 + q)
            out.append((i0, i1, min(starts[i0:i1]), pos[i1 - 1] + 1))
        return out

    def allowed(self, i0: int, i1: int, lo: int, hi: int) -> torch.Tensor:
        """(B, q, W) boolean: query ``i0 + a`` may see key ``lo + j``."""
        kpos = torch.arange(lo, hi, device=self.pos.device)
        causal = kpos[None, None, :] <= self.pos[i0:i1, None][None]
        return causal & (kpos[None, None, :] >= self.start_BS[:, i0:i1, None])


def causal_keys(b: int, s: int, pos: int, device: torch.device) -> Keys:
    """Queries at positions ``pos .. pos + s - 1`` of rows without documents."""
    positions = torch.arange(pos, pos + s, device=device)
    return Keys(positions, torch.zeros(b, s, dtype=torch.long, device=device))


def document_keys(doc_ids_BS: torch.Tensor) -> Keys:
    """Every position of whole rows of packed documents (``doc_ids_BS``: equal neighbours are
    one document)."""
    b, s = doc_ids_BS.shape
    positions = torch.arange(s, device=doc_ids_BS.device)
    starts_BS = torch.ones_like(doc_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    first_BS = torch.where(starts_BS, positions.expand(b, s), 0).cummax(1).values
    return Keys(positions, first_BS)


def _index_scores(qi_BqHD: torch.Tensor, w_BqH: torch.Tensor, ki_BWD: torch.Tensor) -> torch.Tensor:
    """(B, q, W) fp32 scores of a block of queries over ``ki``; also (B, q, Hi, W) relu'd
    per-head products are made (and freed)."""
    b, q, h, d = qi_BqHD.shape
    s_BqHW = torch.matmul(qi_BqHD.reshape(b, q * h, d), ki_BWD.transpose(1, 2)).view(b, q, h, -1)
    return torch.matmul(w_BqH.unsqueeze(2), s_BqHW.relu_()).squeeze(2)


def _top_k_first_of_ties(scores_BqW: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k)``, but where several keys tie with the k-th best score the earliest of
    them are kept, and the kept keys come in position order: which keys a query keeps, and the
    order its attention and KL add them up in, depend on its scores alone, not on how many keys
    its row holds (torch's choice among ties does) nor on the rows beside it, so a block of a
    row selects as the whole row does, and a row as it does in any batch split."""
    top, where = scores_BqW.topk(k, dim=-1)
    kth = top[..., -1:]
    tie = ((scores_BqW >= kth).sum(-1) > k) & (kth[..., 0] > float("-inf"))
    if bool(tie.any()):  # (ties among the keys a query may not see are not selected)
        above, tied = scores_BqW > kth, scores_BqW == kth
        keep = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
        where = keep.nonzero()[:, -1].view(*scores_BqW.shape[:-1], k)  # (k per query, in order)
    else:
        where = where.sort(-1).values
    return scores_BqW.gather(-1, where), where


@torch.no_grad()
def select_keys(
    qi_BSHD: torch.Tensor,
    w_BSH: torch.Tensor,
    ki_BTD: torch.Tensor,
    keys: Keys,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``topk`` highest-scoring keys among those it may see: ``idx_BSk`` (int64
    key positions) and ``valid_BSk`` (False where a query sees fewer than ``topk`` keys; such
    entries' positions are 0)."""
    b, s, h, _ = qi_BSHD.shape
    idx = torch.zeros(b, s, topk, dtype=torch.long, device=qi_BSHD.device)
    valid = torch.zeros(b, s, topk, dtype=torch.bool, device=qi_BSHD.device)
    for i0, i1, lo, hi in keys.blocks(b * h):
        scores = _index_scores(qi_BSHD[:, i0:i1], w_BSH[:, i0:i1], ki_BTD[:, lo:hi])
        scores.masked_fill_(~keys.allowed(i0, i1, lo, hi), float("-inf"))
        kk = min(topk, hi - lo)
        top, where = _top_k_first_of_ties(scores, kk)
        idx[:, i0:i1, :kk] = where + lo
        valid[:, i0:i1, :kk] = top > float("-inf")
    idx.masked_fill_(~valid, 0)
    return idx, valid


def gather_rows(x_BTX: torch.Tensor, idx_Bqk: torch.Tensor) -> torch.Tensor:
    """(B, q, k, X): row ``idx[b, t, j]`` of ``x[b]``."""
    b, t, x = x_BTX.shape
    offsets = torch.arange(b, device=idx_Bqk.device).view(b, 1, 1) * t
    flat = (idx_Bqk + offsets).reshape(-1)
    return x_BTX.reshape(b * t, x).index_select(0, flat).view(*idx_Bqk.shape, x)


def add_rows(grad_BTX: torch.Tensor, idx_Bqk: torch.Tensor, rows_BqkX: torch.Tensor) -> None:
    """The backward of :func:`gather_rows`: add ``rows`` into ``grad`` at their rows."""
    b, t, x = grad_BTX.shape
    offsets = torch.arange(b, device=idx_Bqk.device).view(b, 1, 1) * t
    flat = (idx_Bqk + offsets).reshape(-1)
    rows = rows_BqkX.reshape(-1, x).to(grad_BTX.dtype)
    grad_BTX.view(b * t, x).index_put_((flat,), rows, accumulate=True)


def _relu_grads(
    g_BqW: torch.Tensor, qi_BqHD: torch.Tensor, w_BqH: torch.Tensor, ki_BqWD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``I = sum_h w_h relu(qi_h . ki_j)`` for one block given dL/dI ``g``
    (keys per query ``ki_BqWD``, or shared by the block's queries as (B, 1, W, D)):
    ``(d qi (B, q, Hi, D), d w (B, q, Hi), d ki (B, q or 1, W, D))``."""
    s_BqHW = torch.matmul(qi_BqHD, ki_BqWD.transpose(-1, -2))
    grad_w = torch.matmul(s_BqHW.relu(), g_BqW.unsqueeze(-1)).squeeze(-1)
    ds_BqHW = (s_BqHW > 0).to(g_BqW.dtype).mul_(g_BqW.unsqueeze(2)).mul_(w_BqH.unsqueeze(-1))
    grad_qi = torch.matmul(ds_BqHW, ki_BqWD)
    if ki_BqWD.shape[1] == 1:  # keys shared by the block: sum over its queries
        grad_ki = torch.einsum("bqhw,bqhd->bwd", ds_BqHW, qi_BqHD).unsqueeze(1)
    else:
        grad_ki = torch.matmul(ds_BqHW.transpose(-1, -2), qi_BqHD)
    return grad_qi, grad_w, grad_ki


class _ScoresAt(torch.autograd.Function):
    """``I[t, j]`` at the selected keys ``idx[t, j]`` (B, S, k) fp32; backward a block at a
    time (the keys gathered again)."""

    @staticmethod
    def forward(ctx, qi, w, ki, idx):  # noqa: ANN001, ANN205
        b, s, h, d = qi.shape
        out = qi.new_empty(b, s, idx.shape[-1])
        ctx.blocks = gather_blocks(s, b * idx.shape[-1] * (h + d))
        for i0, i1 in ctx.blocks:
            ki_sel = gather_rows(ki, idx[:, i0:i1])  # (B, q, k, D)
            s_BqHk = torch.matmul(qi[:, i0:i1], ki_sel.transpose(-1, -2))
            out[:, i0:i1] = torch.matmul(w[:, i0:i1].unsqueeze(2), s_BqHk.relu_()).squeeze(2)
        ctx.save_for_backward(qi, w, ki, idx)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        qi, w, ki, idx = ctx.saved_tensors
        grad_qi, grad_w, grad_ki = torch.empty_like(qi), torch.empty_like(w), torch.zeros_like(ki)
        for i0, i1 in ctx.blocks:
            ki_sel = gather_rows(ki, idx[:, i0:i1])
            dq, dw, dk = _relu_grads(g[:, i0:i1], qi[:, i0:i1], w[:, i0:i1], ki_sel)
            grad_qi[:, i0:i1], grad_w[:, i0:i1] = dq, dw
            add_rows(grad_ki, idx[:, i0:i1], dk)
        return grad_qi, grad_w, grad_ki, None


def gather_blocks(s: int, per_query: int) -> list[tuple[int, int]]:
    """Query blocks ``[i0, i1)`` of at most :data:`BLOCK_VALUES` / ``per_query`` queries (at
    least one), for work on each query's own selected keys."""
    q = max(1, BLOCK_VALUES // max(1, per_query))
    return [(i0, min(s, i0 + q)) for i0 in range(0, s, q)]


def index_scores_at(
    qi_BSHD: torch.Tensor, w_BSH: torch.Tensor, ki_BTD: torch.Tensor, idx_BSk: torch.Tensor
) -> torch.Tensor:
    """The index scores (B, S, k) at the selected keys, differentiable in ``qi``, ``w`` and
    ``ki`` (fp32 inputs)."""
    return _ScoresAt.apply(qi_BSHD, w_BSH, ki_BTD, idx_BSk)


def main_probs(
    q_BqHK: torch.Tensor, kv_BWK: torch.Tensor, scale: float, allowed_BqW: torch.Tensor
) -> torch.Tensor:
    """(B, q, W) fp32: the main attention's per-head softmax over the keys each query may see,
    averaged over its heads (no gradient)."""
    with torch.no_grad():
        s_BqHW = torch.matmul(q_BqHK, kv_BWK.unsqueeze(1).transpose(-1, -2))
        s_BqHW = s_BqHW.to(torch.promote_types(s_BqHW.dtype, torch.float32)) * scale
        s_BqHW.masked_fill_(~allowed_BqW.unsqueeze(2), float("-inf"))
        return torch.softmax(s_BqHW, dim=-1).mean(2)


def selected_kl(
    p_BSk: torch.Tensor, scores_BSk: torch.Tensor, valid_BSk: torch.Tensor
) -> torch.Tensor:
    """Each query's ``KL(p || softmax(scores))`` (B, S) over its valid selected keys (``p``:
    the target, zero at invalid entries)."""
    log_q = torch.log_softmax(scores_BSk.masked_fill(~valid_BSk, float("-inf")), dim=-1)
    cross = torch.where(valid_BSk, p_BSk * log_q, 0.0)
    return (torch.xlogy(p_BSk, p_BSk) - cross).sum(-1)


class _DenseKL(torch.autograd.Function):
    """Each query's ``KL(p || softmax(I))`` over every key it may see (B, S); the target ``p``
    from the main attention's absorbed queries and shared keys (no gradient)."""

    @staticmethod
    def forward(ctx, qi, w, ki, q_main, kv_main, scale, keys):  # noqa: ANN001, ANN205
        b, s, h, _ = qi.shape
        kl = qi.new_zeros(b, s)
        ctx.blocks = keys.blocks(b * max(h, q_main.shape[2]))
        for i0, i1, lo, hi in ctx.blocks:
            allowed = keys.allowed(i0, i1, lo, hi)
            p = main_probs(q_main[:, i0:i1], kv_main[:, lo:hi], scale, allowed)
            scores = _index_scores(qi[:, i0:i1], w[:, i0:i1], ki[:, lo:hi])
            log_q = torch.log_softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1)
            cross = torch.where(allowed, p * log_q, 0.0)
            kl[:, i0:i1] = (torch.xlogy(p, p) - cross).sum(-1)
        ctx.scale, ctx.keys = scale, keys
        ctx.save_for_backward(qi, w, ki, q_main, kv_main)
        return kl

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        qi, w, ki, q_main, kv_main = ctx.saved_tensors
        keys = ctx.keys
        grad_qi, grad_w, grad_ki = torch.empty_like(qi), torch.empty_like(w), torch.zeros_like(ki)
        for i0, i1, lo, hi in ctx.blocks:
            allowed = keys.allowed(i0, i1, lo, hi)
            p = main_probs(q_main[:, i0:i1], kv_main[:, lo:hi], ctx.scale, allowed)
            scores = _index_scores(qi[:, i0:i1], w[:, i0:i1], ki[:, lo:hi])
            q = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1)
            dscores = (q - p.to(q.dtype)).mul_(g[:, i0:i1, None])  # (p: fp64 in fp64)
            block_k = ki[:, lo:hi].unsqueeze(1)
            dq, dw, dk = _relu_grads(dscores, qi[:, i0:i1], w[:, i0:i1], block_k)
            grad_qi[:, i0:i1], grad_w[:, i0:i1] = dq, dw
            grad_ki[:, lo:hi] += dk.squeeze(1)
        return grad_qi, grad_w, grad_ki, None, None, None, None


def dense_index_kl(
    qi_BSHD: torch.Tensor,
    w_BSH: torch.Tensor,
    ki_BTD: torch.Tensor,
    q_main_BSHK: torch.Tensor,
    kv_main_BTK: torch.Tensor,
    scale: float,
    keys: Keys,
) -> torch.Tensor:
    """Each query's KL (B, S) from the main attention's distribution over every key it may
    see (``q_main`` / ``kv_main``: its absorbed queries and shared latent-and-rope keys, the
    softmax ``scale``) to the indexer's; differentiable in ``qi``, ``w``, ``ki`` (fp32)."""
    return _DenseKL.apply(qi_BSHD, w_BSH, ki_BTD, q_main_BSHK, kv_main_BTK, scale, keys)


@torch.no_grad()
def top_k_hits(
    idx_BSk: torch.Tensor,
    valid_BSk: torch.Tensor,
    q_main_BSHK: torch.Tensor,
    kv_main_BTK: torch.Tensor,
    scale: float,
    keys: Keys,
) -> torch.Tensor:
    """How many of the ``k`` keys the main attention weighs most (its heads' mean over every
    key the query may see; all of them where a query sees at most ``k``) the indexer selected,
    summed over the queries (fp32 scalar; out of :meth:`Keys.wanted`)."""
    b, s, topk = idx_BSk.shape
    hits = idx_BSk.new_zeros((), dtype=torch.float32)
    for i0, i1, lo, hi in keys.blocks(b * q_main_BSHK.shape[2]):
        allowed = keys.allowed(i0, i1, lo, hi)
        p = main_probs(q_main_BSHK[:, i0:i1], kv_main_BTK[:, lo:hi], scale, allowed)
        p.masked_fill_(~allowed, -1.0)
        top, dense = p.topk(min(topk, hi - lo), dim=-1)
        wanted = top >= 0  # (a query that sees fewer keys than that)
        chosen = torch.zeros(allowed.shape, dtype=torch.uint8, device=allowed.device)
        sel = (idx_BSk[:, i0:i1] - lo).clamp_(0, hi - lo - 1)
        chosen.scatter_reduce_(-1, sel, valid_BSk[:, i0:i1].to(torch.uint8), "amax")
        hits = hits + (chosen.gather(-1, dense).bool() & wanted).sum()
    return hits


def top_k_recall(
    idx_BSk: torch.Tensor,
    valid_BSk: torch.Tensor,
    q_main_BSHK: torch.Tensor,
    kv_main_BTK: torch.Tensor,
    scale: float,
    keys: Keys,
) -> torch.Tensor:
    """The mean over queries of ``|selected & dense top-k| / |dense top-k|``: the share of the
    ``k`` keys the main attention weighs most that the indexer selected
    (:func:`top_k_hits` over :meth:`Keys.wanted`; 1 where a query sees at most ``k`` keys)."""
    hits = top_k_hits(idx_BSk, valid_BSk, q_main_BSHK, kv_main_BTK, scale, keys)
    return hits / keys.wanted(idx_BSk.shape[-1]).clamp_min(1)
