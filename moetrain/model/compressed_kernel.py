"""DeepSeek-V4's attention core: each query attends to the keys of its sliding window and to the
compressed entries it may see, one key/value head read as both keys and values, with a sink
logit per head beside them (dropped after the softmax).

Exact softmax attention computed a block of queries at a time, forward and backward (a written
backward that recomputes each block's probabilities from the row's log-sum-exp), so no (S, S)
tensor is ever built: a block holds (B, H, Q, Q + window + W) logits, and backward keeps only
the queries, the keys, the entries, the output, each row's log-sum-exp and the csa selection.

The entries a query sees: with ``picks`` (compressed sparse attention), the entries of its
``(idx_BSk, valid_BSk)``; without (heavily compressed), every entry whose window has closed by
its position (entry w is seen from position ``(w + 1) rate - 1`` on).

Shape legend: B batch, H heads, S sequence, K head dim, W entries, k picks per query, Q block,
T keys of a block.
"""

from __future__ import annotations

import torch

BLOCK = 64  # queries per block


def block_keys(
    kv_BSK: torch.Tensor,
    entries_BWK: torch.Tensor,
    picks: tuple[torch.Tensor, torch.Tensor] | None,
    start: int,
    stop: int,
    window: int,
    rate: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The keys of queries ``start .. stop - 1`` (B, T, K): the window's rows ``lo .. stop - 1``,
    then every entry; which of them each query sees (B, Q, T), and ``lo``."""
    b, dev = kv_BSK.shape[0], kv_BSK.device
    lo = max(0, start - window + 1)
    q_pos = torch.arange(start, stop, device=dev)
    lag = q_pos[:, None] - torch.arange(lo, stop, device=dev)[None, :]
    seen = ((lag >= 0) & (lag < window)).expand(b, -1, -1)
    n = entries_BWK.shape[1]
    if picks is None:
        closed = torch.arange(n, device=dev) < ((q_pos + 1) // rate)[:, None]
        seen_entries = closed.expand(b, -1, -1)
    else:
        idx, valid = picks[0][:, start:stop], picks[1][:, start:stop]
        seen_entries = idx.new_zeros(b, stop - start, n, dtype=torch.bool)
        seen_entries.scatter_(-1, idx, valid)
    keys = torch.cat((kv_BSK[:, lo:stop], entries_BWK), dim=1)
    return keys, torch.cat((seen, seen_entries), dim=-1), lo


def _logits(q_BHQK: torch.Tensor, keys_BTK: torch.Tensor, seen: torch.Tensor, scale: float):
    """fp32 (B, H, Q, T) logits, -inf where not seen."""
    logits = torch.matmul(q_BHQK, keys_BTK.unsqueeze(1).transpose(-1, -2)).float() * scale
    return logits.masked_fill(~seen.unsqueeze(1), float("-inf"))


class _WindowEntryAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, entries, idx, valid, sinks, window, rate, scale):  # noqa: ANN001, ANN205
        b, h, s, _ = q.shape
        picks = None if idx is None else (idx, valid)
        out = torch.empty_like(q)
        lse = q.new_empty(b, h, s, dtype=torch.float32)
        sink = sinks.float().view(1, h, 1, 1)
        for start in range(0, s, BLOCK):
            stop = min(s, start + BLOCK)
            keys, seen, _ = block_keys(kv, entries, picks, start, stop, window, rate)
            logits = _logits(q[:, :, start:stop], keys, seen, scale)
            top = torch.maximum(logits.amax(-1, keepdim=True), sink)
            e = torch.exp(logits - top)
            total = e.sum(-1, keepdim=True) + torch.exp(sink - top)
            out[:, :, start:stop] = torch.matmul((e / total).to(kv.dtype), keys.unsqueeze(1))
            lse[:, :, start:stop] = (top + total.log()).squeeze(-1)
        ctx.save_for_backward(q, kv, entries, idx, valid, sinks, out, lse)
        ctx.window, ctx.rate, ctx.scale = window, rate, scale
        return out

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        q, kv, entries, idx, valid, sinks, out, lse = ctx.saved_tensors
        picks = None if idx is None else (idx, valid)
        b, h, s, _ = q.shape
        n = entries.shape[1]
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        d_entries = torch.zeros_like(entries, dtype=torch.float32)
        d_sinks = torch.zeros(h, dtype=torch.float32, device=q.device)
        d_out = d_out.float()
        delta = (d_out * out.float()).sum(-1)  # (B, H, S)
        sink = sinks.float().view(1, h, 1)
        for start in range(0, s, BLOCK):
            stop = min(s, start + BLOCK)
            keys, seen, lo = block_keys(kv, entries, picks, start, stop, ctx.window, ctx.rate)
            q_blk = q[:, :, start:stop]
            rows_lse = lse[:, :, start:stop]
            p = torch.exp(_logits(q_blk, keys, seen, ctx.scale) - rows_lse.unsqueeze(-1))
            do = d_out[:, :, start:stop]
            rows_delta = delta[:, :, start:stop]
            keys32 = keys.float().unsqueeze(1)
            d_logits = p * (torch.matmul(do, keys32.transpose(-1, -2)) - rows_delta.unsqueeze(-1))
            dq[:, :, start:stop] = torch.matmul(d_logits, keys32) * ctx.scale
            d_keys = torch.matmul(d_logits.transpose(-1, -2), q_blk.float()) * ctx.scale
            d_keys = (d_keys + torch.matmul(p.transpose(-1, -2), do)).sum(1)  # (B, T, K)
            dkv[:, lo:stop] += d_keys[:, : stop - lo]
            d_entries += d_keys[:, stop - lo :]
            d_sinks -= (torch.exp(sink - rows_lse) * rows_delta).sum((0, 2))
        d_entries = d_entries.to(entries.dtype) if n else None
        return (
            dq.to(q.dtype),
            dkv.to(kv.dtype),
            d_entries,
            None,
            None,
            d_sinks.to(sinks.dtype),
            None,
            None,
            None,
        )


@torch.no_grad()
def window_entry_logit_max(
    q_BHSK: torch.Tensor,
    kv_BSK: torch.Tensor,
    entries_BWK: torch.Tensor,
    picks: tuple[torch.Tensor, torch.Tensor] | None,
    window: int,
    rate: int,
    scale: float,
) -> torch.Tensor:
    """(H,) fp32: each head's largest logit over the keys and entries its queries see (the
    sinks left out), a block of queries at a time."""
    out = torch.full((q_BHSK.shape[1],), float("-inf"), device=q_BHSK.device)
    for start in range(0, q_BHSK.shape[2], BLOCK):
        stop = min(q_BHSK.shape[2], start + BLOCK)
        keys, seen, _ = block_keys(kv_BSK, entries_BWK, picks, start, stop, window, rate)
        logits = _logits(q_BHSK[:, :, start:stop], keys, seen, scale)
        out = torch.maximum(out, logits.amax(dim=(0, 2, 3)))
    return out


def window_entry_attention(
    q_BHSK: torch.Tensor,
    kv_BSK: torch.Tensor,
    entries_BWK: torch.Tensor,
    picks: tuple[torch.Tensor, torch.Tensor] | None,
    sinks_H: torch.Tensor,
    window: int,
    rate: int,
    scale: float,
) -> torch.Tensor:
    """(B, H, S, K) attention of queries at positions ``0 .. S - 1`` over their window's keys
    ``kv_BSK`` and the entries they see (module docstring), with a sink logit per head."""
    idx, valid = picks if picks is not None else (None, None)
    return _WindowEntryAttention.apply(
        q_BHSK, kv_BSK, entries_BWK, idx, valid, sinks_H, window, rate, scale
    )
