"""Causal attention with a sliding window, in chunks, and / or with attention sinks, exact and
without an S x S tensor.

Shape legend: B batch, H query heads, G key/value heads, S sequence, Hd head dim, W window,
C chunk of queries (= W), n new queries against a cache of P positions.

Sliding window (transformers' rule): query i sees keys ``i - W < j <= i``. The queries are cut
into chunks of W; chunk 0 is plain causal attention over its own W positions, and every later
chunk c attends to the 2W - 1 keys ``[cW - W + 1, cW + W)`` under one (W, 2W - 1) band mask
shared by all chunks, in one batched ``scaled_dot_product_attention`` call. Memory is linear
in S (the key windows copy K and V about twice); the band mask is W x (2W - 1) booleans.

Chunked attention (Llama 4's ``attention_chunk_size`` C): query i sees keys ``j <= i`` with
``j // C == i // C``, positions counted from the start of the row. The sequence is cut into
chunks of C (the last one padded at its end, which causal attention never lets a real query
see) and the chunks are one batch of plain causal attention: memory and work are linear in S.
With packed documents, a query sees its own document's part of its chunk: the documents are
cut at the chunk boundaries (:func:`chunk_segments`) and attended as documents.

Attention sinks (gpt-oss): each head h adds ``exp(sink_h)`` to its softmax's denominator, a
key column whose value is zero. Exact with any SDPA kernel: every head dim gets
:data:`SINK_PAD` more dims; queries carry ``sink_h / scale`` in the first of them, the real
keys zero there, and one shared sink key carries 1 there and zeros elsewhere, so its score is
``sink_h`` for every query of head h (the other scores are unchanged) and the sink logit gets
its gradient through the queries. The sink key is put first; under plain causal attention one
zero query is put first too, so that ``is_causal`` over (S + 1) x (S + 1) lets every real query
see the sink and its own past (the extra query sees only the sink, whose value is zero, and its
output is dropped). The padding costs :data:`SINK_PAD` / Hd more attention memory and FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SINK_PAD = 8  # extra head dims for the sink (a multiple of 8 keeps the fused kernels' alignment)


def with_sink_dims(
    q_BHSHd: torch.Tensor,
    k_BGSHd: torch.Tensor,
    v_BGSHd: torch.Tensor,
    sinks_H: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with :data:`SINK_PAD` more head dims (the queries' first one ``sink_h / scale``)
    and the sink key / zero value first along the key axis: (B, G, 1 + S, Hd + pad)."""
    b, h, s, hd = q_BHSHd.shape
    c = (sinks_H.to(q_BHSHd.dtype) / scale).view(1, h, 1, 1).expand(b, h, s, 1)
    q = torch.cat([q_BHSHd, c, q_BHSHd.new_zeros(b, h, s, SINK_PAD - 1)], dim=-1)
    k = F.pad(k_BGSHd, (0, SINK_PAD, 1, 0))
    k[:, :, 0, hd] = 1.0  # (k is a fresh tensor: the pad's output)
    v = F.pad(v_BGSHd, (0, SINK_PAD, 1, 0))
    return q, k, v


def _sdpa(q, k, v, mask, causal, gqa, scale):  # noqa: ANN001, ANN202
    """SDPA with grouped K/V expanded to the query heads for a masked GPU call (the fused
    kernels that take a mask do not all take grouped K/V; on the CPU they do)."""
    if gqa and mask is not None and q.device.type != "cpu":
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, scale=scale
    )


def _causal_with_sinks(q, k, v, sinks, gqa, scale):  # noqa: ANN001, ANN202
    hd = v.shape[-1]
    q, k, v = with_sink_dims(q, k, v, sinks, scale)
    q = F.pad(q, (0, 0, 1, 0))  # the extra first query (sees only the sink)
    return _sdpa(q, k, v, None, True, gqa, scale)[:, :, 1:, :hd]


def band_mask(window: int, sink: bool, device: torch.device) -> torch.Tensor:
    """(W, 2W - 1) boolean: query a of a chunk sees key window entries ``a .. a + W - 1``
    (keys ``[cW - W + 1, cW + W)`` of chunk c); with ``sink`` a True column first."""
    a = torch.arange(window, device=device)[:, None]
    j = torch.arange(2 * window - 1, device=device)[None, :]
    band = (j >= a) & (j < a + window)
    return F.pad(band, (1, 0), value=True) if sink else band


def _banded(q, k, v, window, sinks, gqa, scale):  # noqa: ANN001, ANN202
    """Chunks 1.. of a windowed causal attention (queries from position W on)."""
    b, h, s, qd = q.shape
    w, vd = window, v.shape[-1]
    if sinks is not None:
        q, k, v = with_sink_dims(q, k, v, sinks, scale)
        k, v = k[:, :, 1:], v[:, :, 1:]  # (the sink key is added to every chunk below)
    n = -(-(s - w) // w)  # chunks after the first
    pad = n * w - (s - w)

    def windows(x: torch.Tensor) -> torch.Tensor:  # (B, G, S, X) -> (B*n, G, 2W-1, X)
        xp = F.pad(x[:, :, 1:], (0, 0, 0, pad))  # keys from position 1: chunk c starts at cW-W+1
        g, d = xp.shape[1], xp.shape[-1]
        win = xp.unfold(2, 2 * w - 1, w)  # (B, G, n, X, 2W-1)
        return win.permute(0, 2, 1, 4, 3).reshape(b * n, g, 2 * w - 1, d)

    kw, vw = windows(k), windows(v)
    if sinks is not None:
        sink_key = kw.new_zeros(kw.shape[0], kw.shape[1], 1, kw.shape[-1])
        sink_key[..., qd] = 1.0  # (the sink dim follows the query/key dims)
        kw = torch.cat([sink_key, kw], dim=2)
        vw = F.pad(vw, (0, 0, 1, 0))
    qc = F.pad(q[:, :, w:], (0, 0, 0, pad)).view(b, h, n, w, -1).transpose(1, 2)
    qc = qc.reshape(b * n, h, w, -1)
    mask = band_mask(w, sinks is not None, q.device)
    out = _sdpa(qc, kw, vw, mask, False, gqa, scale)  # (B*n, H, W, X)
    out = out.view(b, n, h, w, -1).transpose(1, 2).reshape(b, h, n * w, -1)
    return out[:, :, : s - w, :vd]


def local_attention(
    q_BHSHd: torch.Tensor,
    k_BGSHd: torch.Tensor,
    v_BGSHd: torch.Tensor,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of S queries over the same S positions (B, H, S, Hd): each query sees
    the last ``window`` positions, itself included (None: all of them), and with ``sinks_H``
    (H,) each head's sink logit joins its softmax's denominator (see the module docstring).
    Equal to ``scaled_dot_product_attention`` under the explicit mask with the sink column."""
    scale = q_BHSHd.shape[-1] ** -0.5 if scale is None else scale
    s = q_BHSHd.shape[2]
    if window is None or window >= s:
        if sinks_H is None:
            return _sdpa(q_BHSHd, k_BGSHd, v_BGSHd, None, True, enable_gqa, scale)
        return _causal_with_sinks(q_BHSHd, k_BGSHd, v_BGSHd, sinks_H, enable_gqa, scale)
    head = local_attention(
        q_BHSHd[:, :, :window],
        k_BGSHd[:, :, :window],
        v_BGSHd[:, :, :window],
        None,
        sinks_H,
        enable_gqa,
        scale,
    )
    rest = _banded(q_BHSHd, k_BGSHd, v_BGSHd, window, sinks_H, enable_gqa, scale)
    return torch.cat([head, rest], dim=2)


def chunked_attention(
    q_BHSHd: torch.Tensor,
    k_BGSHd: torch.Tensor,
    v_BGSHd: torch.Tensor,
    chunk: int,
    sinks_H: torch.Tensor | None = None,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of S queries over the same S positions (B, H, S, Hd) within chunks of
    ``chunk`` positions (query i sees keys ``j <= i`` with ``j // chunk == i // chunk``), with
    ``sinks_H`` as :func:`local_attention` has them. Equal to ``scaled_dot_product_attention``
    under the explicit chunked causal mask."""
    scale = q_BHSHd.shape[-1] ** -0.5 if scale is None else scale
    b, h, s, _ = q_BHSHd.shape
    if s <= chunk:
        return local_attention(q_BHSHd, k_BGSHd, v_BGSHd, None, sinks_H, enable_gqa, scale)
    n = -(-s // chunk)
    pad = n * chunk - s

    def chunks(x: torch.Tensor) -> torch.Tensor:  # (B, G, S, X) -> (B*n, G, C, X)
        g, d = x.shape[1], x.shape[-1]
        xp = F.pad(x, (0, 0, 0, pad)).view(b, g, n, chunk, d)
        return xp.transpose(1, 2).reshape(b * n, g, chunk, d)

    out = local_attention(
        chunks(q_BHSHd), chunks(k_BGSHd), chunks(v_BGSHd), None, sinks_H, enable_gqa, scale
    )
    out = out.view(b, n, h, chunk, -1).transpose(1, 2).reshape(b, h, n * chunk, -1)
    return out[:, :, :s]


def chunk_segments(doc_ids_BS: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, S) int64 ids of the runs of ``doc_ids_BS`` cut at every multiple of ``chunk``
    (positions from 0): equal neighbouring ids are one document's part of one chunk, what a
    query of a chunked layer may see under packed documents."""
    s = doc_ids_BS.shape[1]
    starts_BS = torch.ones_like(doc_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    starts_BS[:, torch.arange(s, device=doc_ids_BS.device) % chunk == 0] = True
    return starts_BS.long().cumsum(1)


def cached_attention(
    q_BHnHd: torch.Tensor,
    k_BGPHd: torch.Tensor,
    v_BGPHd: torch.Tensor,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
    enable_gqa: bool = False,
    scale: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """n new queries, the last n of the P cached positions (their keys and values included),
    under the same rule as :func:`local_attention` (with ``chunk``, :func:`chunked_attention`'s;
    not with ``window``). Only the keys some new query sees are attended (the last n + W - 1
    with a window, those from the first query's chunk on with chunks); the mask is
    n x (those + 1), none when n == 1 (decoding)."""
    if window is not None and chunk is not None:
        raise ValueError("cached_attention: a sliding window or chunks, not both")
    scale = q_BHnHd.shape[-1] ** -0.5 if scale is None else scale
    n, p = q_BHnHd.shape[2], k_BGPHd.shape[2]
    if n == p and chunk is not None:  # prefill: the queries are every position
        return chunked_attention(q_BHnHd, k_BGPHd, v_BGPHd, chunk, sinks_H, enable_gqa, scale)
    if n == p:
        return local_attention(q_BHnHd, k_BGPHd, v_BGPHd, window, sinks_H, enable_gqa, scale)
    lo = 0 if window is None else max(0, p - n - window + 1)
    if chunk is not None:  # the first new query's chunk starts here
        lo = (p - n) // chunk * chunk
    k, v = k_BGPHd[:, :, lo:], v_BGPHd[:, :, lo:]
    mask = None
    if n > 1:
        qpos = torch.arange(p - n, p, device=q_BHnHd.device)[:, None]
        kpos = torch.arange(lo, p, device=q_BHnHd.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask = mask & (kpos > qpos - window)
        if chunk is not None:
            mask = mask & (kpos // chunk == qpos // chunk)
    elif window is not None:
        k, v = k[:, :, -window:], v[:, :, -window:]
    hd = v.shape[-1]
    q = q_BHnHd
    if sinks_H is not None:
        q, k, v = with_sink_dims(q, k, v, sinks_H, scale)
        if mask is not None:
            mask = F.pad(mask, (1, 0), value=True)
    return _sdpa(q, k, v, mask, False, enable_gqa, scale)[..., :hd]
