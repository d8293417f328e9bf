"""The largest pre-softmax attention logit of each head: what attention-logit growth (the
instability QK-clip / MuonClip answers) is watched by.

An attention module calls :func:`observe_logits` with its final queries and keys (after RoPE,
norms and temperature; the softmax scale applied) and the positions its softmax sees: causal,
within documents, a sliding window, chunks, or an explicit mask; attention sinks are not query-key
logits and are left out. It does nothing unless the module's ``track_logits`` is True (set from
outside, for the steps that need it); then the module's ``logit_max_H`` (fp32, one value per
query head, -inf where a head saw nothing) takes the maximum with this call's. Under sequence
parallelism the module holds a slice of the heads, at ``head_exchange.rank * local heads``.
Computed without gradients, a block of queries at a time (no S x S tensor per head).
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.model.doc_attention import Documents

QUERY_BLOCK = 256


def document_ids(docs: Documents) -> torch.Tensor:
    """(B, S) int64: a number per document of ``docs``, equal within a document."""
    flat = torch.full((docs.batch * docs.seq_len + 1,), -1, dtype=torch.long)
    first = 0
    for index_NL, real_NL in docs.buckets:
        index, real = index_NL.cpu(), real_NL.cpu()
        ids = torch.arange(first, first + index.shape[0])[:, None].expand_as(index)
        flat[index[real]] = ids[real]
        first += index.shape[0]
    return flat[:-1].view(docs.batch, docs.seq_len)


def _allowed(
    rows: range,
    keys: int,
    device: torch.device,
    doc_ids_BS: torch.Tensor | None,
    window: int | None,
    chunk: int | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """(B or 1, 1, rows, keys) boolean: which keys the queries ``rows`` see."""
    if mask is not None:  # explicit (boolean, or additive): it alone says
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        ok = allowed[:, :, rows.start : rows.stop, :keys]
    else:
        i = torch.arange(rows.start, rows.stop, device=device)[:, None]
        j = torch.arange(keys, device=device)[None, :]
        ok = j <= i
        if window is not None:
            ok = ok & (j > i - window)
        if chunk is not None:
            ok = ok & (torch.div(j, chunk, rounding_mode="floor") == i // chunk)
        ok = ok[None, None]
    if doc_ids_BS is not None:
        d = doc_ids_BS.to(device)
        ok = ok & (d[:, None, rows.start : rows.stop, None] == d[:, None, None, :keys])
    return ok


@torch.no_grad()
def logit_max(
    q_BHSK: torch.Tensor,
    k_BGTK: torch.Tensor,
    scale: float,
    mask: torch.Tensor | Documents | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """(H,) fp32: each query head's largest ``scale * q . k`` over the positions it attends to
    (key head ``h // (H / G)`` for query head h)."""
    b, h, s, d = q_BHSK.shape
    g, t = k_BGTK.shape[1], k_BGTK.shape[2]
    docs = document_ids(mask) if isinstance(mask, Documents) else None
    explicit = mask if isinstance(mask, torch.Tensor) else None
    q = q_BHSK.float().reshape(b, g, h // g, s, d)
    k = k_BGTK.float()[:, :, None]
    best = torch.full((h,), float("-inf"), device=q_BHSK.device)
    for start in range(0, s, QUERY_BLOCK):
        rows = range(start, min(s, start + QUERY_BLOCK))
        scores = (q[:, :, :, rows.start : rows.stop] @ k.mT) * scale  # (B, G, r, rows, T)
        ok = _allowed(rows, t, q.device, docs, window, chunk, explicit)  # (B|1, 1, rows, T)
        scores = scores.masked_fill(~ok[:, :, None], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).reshape(h))
    return best


def observe_logits(
    module: nn.Module,
    q_BHSK: torch.Tensor,
    k_BGTK: torch.Tensor,
    scale: float,
    mask: torch.Tensor | Documents | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> None:
    """When ``module.track_logits``: fold this call's per-head maxima (:func:`logit_max`) into
    ``module.logit_max_H`` (module docstring)."""
    if not getattr(module, "track_logits", False):
        return
    local = logit_max(q_BHSK, k_BGTK, scale, mask, window, chunk)
    exchange = getattr(module, "head_exchange", None)
    offset = exchange.rank * local.numel() if exchange is not None else 0
    heads = module.n_heads
    current = getattr(module, "logit_max_H", None)
    if current is None or current.numel() != heads:
        current = torch.full((heads,), float("-inf"), device=local.device)
    current[offset : offset + local.numel()] = torch.maximum(
        current[offset : offset + local.numel()], local
    )
    module.logit_max_H = current
