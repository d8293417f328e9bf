"""DeepSeek-V4's attention core: each query attends to the keys of its sliding window and to the
compressed entries it may see, one key/value head read as both keys and values, with a sink
logit per head beside them (dropped after the softmax).

Exact softmax attention computed a block of queries at a time, forward and backward (a written
backward that recomputes each block's probabilities), so no (S, S) tensor is ever built: a block
holds (B, Q H, T + 1) logits, and backward keeps only the scaled queries, the keys, the entries,
the output and the csa selection.

The heads share the key, so a block's queries of every head are the rows of one matrix
(queries in (B, S, H, K) order: a block of them is a view): one GEMM per batch row scores them
all, and the key gradients come out summed over the heads. The sink is the logits' last column,
scored by the GEMM itself: each query carries a one-hot of its head in H extra channels, the
keys zeros there, and a sink key the sinks (exact for finite values: the extra products are 0
or the sink times 1); one softmax then gives the probabilities and the sink's share. The window's and the
entries' masks are added in place, as 0 or -inf.

The entries a query sees: with ``picks`` (compressed sparse attention), the entries of its
``(idx_BSk, valid_BSk)``; without (heavily compressed), every entry whose window has closed by
its position (entry w is seen from position ``(w + 1) rate - 1`` on).

Shape legend: B batch, H heads, S sequence, K head dim, W entries, k picks per query, Q block,
T keys of a block (window rows, then entries).
"""

from __future__ import annotations

import functools

import torch

BLOCK = 32  # queries per block (a block of Q computes Q + window - 1 window logits per query)


def _bias(seen: torch.Tensor) -> torch.Tensor:
    """fp32 0 where ``seen``, -inf where not (added to logits)."""
    return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))


def _with_heads(q_BSHK: torch.Tensor) -> torch.Tensor:
    """fp32 (B, S, H, K + H): the queries, then a one-hot of their head (scores the sink)."""
    b, s, h, _ = q_BSHK.shape
    one_hot = torch.eye(h, device=q_BSHK.device).expand(b, s, h, h)
    return torch.cat((q_BSHK.float(), one_hot), dim=-1)


@functools.lru_cache(maxsize=64)
def _window_bias(offset: int, q: int, window: int, device: torch.device) -> torch.Tensor:
    """(Q, 1, offset + Q): 0 where query ``i`` sees window row ``j`` (rows from ``offset``
    before the block's first query to its last), -inf where not; shared, never written."""
    lag = torch.arange(offset, offset + q, device=device)[:, None] - torch.arange(
        offset + q, device=device
    )
    return _bias((lag >= 0) & (lag < window)).unsqueeze(1)


class _Blocks:
    """What every block of queries of one call needs: the keys (each with H zero channels, then
    the sink key: zeros, then the sinks), the masks."""

    def __init__(self, kv_BSK, entries_BWK, idx, valid, sinks_H, window: int, rate: int) -> None:  # noqa: ANN001
        b, h = kv_BSK.shape[0], sinks_H.shape[0]
        self.k, self.window = kv_BSK.shape[-1], window
        zeros = kv_BSK.new_zeros((), dtype=torch.float32)
        self.kv = torch.cat((kv_BSK.float(), zeros.expand(b, kv_BSK.shape[1], h)), dim=-1)
        sink = torch.cat((zeros.expand(self.k), sinks_H.float()))
        entries = torch.cat((entries_BWK.float(), zeros.expand(b, entries_BWK.shape[1], h)), -1)
        self.tail = torch.cat((entries, sink.expand(b, 1, -1)), dim=1)  # (B, W + 1, K + H)
        self.picks = None if idx is None else (idx, _bias(valid))
        if idx is None:  # (S, W) every closed entry
            dev = kv_BSK.device
            pos = torch.arange(1, kv_BSK.shape[1] + 1, device=dev)
            self.closed = _bias(
                torch.arange(entries_BWK.shape[1], device=dev) < (pos // rate)[:, None]
            )

    def keys(self, start: int, stop: int) -> tuple[torch.Tensor, int]:
        """The keys (B, T + 1, K + H) of queries ``start .. stop - 1``: window rows
        ``lo .. stop - 1``, every entry, the sink key; and ``lo``."""
        lo = max(0, start - self.window + 1)
        return torch.cat((self.kv[:, lo:stop], self.tail), dim=1), lo

    def entry_bias(self, start: int, stop: int) -> torch.Tensor:
        """(B or 1, Q, 1, W) 0 where a query sees the entry, -inf where not."""
        if self.picks is None:
            return self.closed[None, start:stop, None]
        idx, pick_bias = self.picks[0][:, start:stop], self.picks[1][:, start:stop]
        bias = torch.full(
            (*idx.shape[:2], self.tail.shape[1] - 1), float("-inf"), device=idx.device
        )
        return bias.scatter_(-1, idx, pick_bias).unsqueeze(2)

    def logits(self, q_BQHX: torch.Tensor, start: int, stop: int):  # noqa: ANN201
        """fp32 logits (B, Q H, T + 1) of the block's queries (scaled, with their heads), -inf
        where not seen, the sink's last; its keys (B, T + 1, K + H) and ``lo``."""
        b, q, h, x = q_BQHX.shape
        keys, lo = self.keys(start, stop)
        logits = torch.bmm(q_BQHX.reshape(b, q * h, x), keys.transpose(1, 2))
        by_head = logits.view(b, q, h, -1)
        by_head[..., : stop - lo].add_(_window_bias(start - lo, q, self.window, logits.device))
        if keys.shape[1] > stop - lo + 1:
            by_head[..., stop - lo : -1].add_(self.entry_bias(start, stop))
        return logits, keys, lo


class _WindowEntryAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, entries, idx, valid, sinks, window, rate, scale):  # noqa: ANN001, ANN205
        b, s, h, k = q.shape
        q_scaled = q * scale
        q_ext = _with_heads(q_scaled)
        blocks = _Blocks(kv, entries, idx, valid, sinks, window, rate)
        outs = []
        for start in range(0, s, BLOCK):
            stop = min(s, start + BLOCK)
            logits, keys, _ = blocks.logits(q_ext[:, start:stop], start, stop)
            p = torch.softmax(logits, dim=-1)
            outs.append(torch.bmm(p[..., :-1], keys[:, :-1, :k]).view(b, -1, h, k))
        out = torch.cat(outs, dim=1).to(q.dtype)
        ctx.save_for_backward(q_scaled, kv, entries, idx, valid, sinks, out)
        ctx.window, ctx.rate, ctx.scale = window, rate, scale
        return out

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        q_scaled, kv, entries, idx, valid, sinks, out = ctx.saved_tensors
        b, s, h, k = q_scaled.shape
        tw = kv.shape[1]
        q_ext = _with_heads(q_scaled)
        blocks = _Blocks(kv, entries, idx, valid, sinks, ctx.window, ctx.rate)
        d_out = d_out.float().contiguous()
        delta = (d_out * out.float()).sum(-1).view(b, s * h)  # (B, S H): rows of dO . O
        sink_p = torch.empty_like(delta)  # the sink's probability per row
        dqs, d_keys_all = [], q_scaled.new_zeros(b, tw + entries.shape[1], k, dtype=torch.float32)
        for start in range(0, s, BLOCK):
            stop = min(s, start + BLOCK)
            logits, keys, lo = blocks.logits(q_ext[:, start:stop], start, stop)
            p = torch.softmax(logits, dim=-1)
            sink_p[:, start * h : stop * h] = p[..., -1]
            p, keys = p[..., :-1], keys[:, :-1, :k]
            do = d_out[:, start:stop].view(b, -1, k)
            dl = torch.bmm(do, keys.transpose(1, 2))  # dP, then the logits' gradient
            dl.sub_(delta[:, start * h : stop * h, None]).mul_(p)
            dqs.append(torch.bmm(dl, keys))
            d_keys = torch.bmm(dl.transpose(1, 2), q_ext[:, start:stop, :, :k].reshape(b, -1, k))
            d_keys.baddbmm_(p.transpose(1, 2), do)  # (B, T, K)
            d_keys_all[:, lo:stop] += d_keys[:, : stop - lo]
            d_keys_all[:, tw:] += d_keys[:, stop - lo :]
        dq = torch.cat(dqs, dim=1).view(b, s, h, k).mul_(ctx.scale)
        d_sinks = -(sink_p * delta).view(b, s, h).sum((0, 1))
        d_entries = d_keys_all[:, tw:].to(entries.dtype) if entries.shape[1] else None
        return (
            dq.to(q_scaled.dtype),
            d_keys_all[:, :tw].to(kv.dtype),
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
    q_BSHK: torch.Tensor,
    kv_BSK: torch.Tensor,
    entries_BWK: torch.Tensor,
    picks: tuple[torch.Tensor, torch.Tensor] | None,
    window: int,
    rate: int,
    scale: float,
) -> torch.Tensor:
    """(H,) fp32: each head's largest logit over the keys and entries its queries see (the
    sinks left out), a block of queries at a time."""
    b, s, h, _ = q_BSHK.shape
    idx, valid = picks if picks is not None else (None, None)
    sinks = torch.zeros(h, device=q_BSHK.device)  # (its column left out)
    blocks = _Blocks(kv_BSK, entries_BWK, idx, valid, sinks, window, rate)
    q_ext = _with_heads(q_BSHK.float() * scale)
    out = torch.full((h,), float("-inf"), device=q_BSHK.device)
    for start in range(0, s, BLOCK):
        stop = min(s, start + BLOCK)
        logits, _, _ = blocks.logits(q_ext[:, start:stop], start, stop)
        by_head = logits.view(b, stop - start, h, -1)[..., :-1]
        out = torch.maximum(out, by_head.amax(dim=(0, 1, 3)))
    return out


def window_entry_attention(
    q_BSHK: torch.Tensor,
    kv_BSK: torch.Tensor,
    entries_BWK: torch.Tensor,
    picks: tuple[torch.Tensor, torch.Tensor] | None,
    sinks_H: torch.Tensor,
    window: int,
    rate: int,
    scale: float,
) -> torch.Tensor:
    """(B, S, H, K) attention of queries at positions ``0 .. S - 1`` over their window's keys
    ``kv_BSK`` and the entries they see (module docstring), with a sink logit per head."""
    idx, valid = picks if picks is not None else (None, None)
    return _WindowEntryAttention.apply(
        q_BSHK.contiguous(), kv_BSK, entries_BWK, idx, valid, sinks_H, window, rate, scale
    )
