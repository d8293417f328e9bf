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
so one softmax gives the probabilities and the sink's share (its gradient, in backward); the
window's and the entries' masks are added in place, as 0 or -inf.

The entries a query sees: with ``picks`` (compressed sparse attention), the entries of its
``(idx_BSk, valid_BSk)``; without (heavily compressed), every entry whose window has closed by
its position (entry w is seen from position ``(w + 1) rate - 1`` on).

Shape legend: B batch, H heads, S sequence, K head dim, W entries, k picks per query, Q block,
T keys of a block (window rows, then entries).
"""

from __future__ import annotations

import torch

BLOCK = 64  # queries per block


def _bias(seen: torch.Tensor) -> torch.Tensor:
    """fp32 0 where ``seen``, -inf where not (added to logits)."""
    return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))


class _Blocks:
    """What every block of queries of one call needs: the keys, the masks and the sinks."""

    def __init__(self, kv_BSK, entries_BWK, idx, valid, sinks_H, window: int, rate: int) -> None:  # noqa: ANN001
        self.kv, self.entries, self.sinks = kv_BSK.float(), entries_BWK.float(), sinks_H.float()
        self.window, self.rate = window, rate
        self.picks = None if idx is None else (idx, _bias(valid))
        self._window_bias: dict[tuple[int, int], torch.Tensor] = {}

    def keys(self, start: int, stop: int) -> tuple[torch.Tensor, int]:
        """The keys (B, T, K) of queries ``start .. stop - 1``: window rows ``lo .. stop - 1``
        then every entry; and ``lo``."""
        lo = max(0, start - self.window + 1)
        if self.entries.shape[1] == 0:
            return self.kv[:, lo:stop], lo
        return torch.cat((self.kv[:, lo:stop], self.entries), dim=1), lo

    def window_bias(self, start: int, stop: int, lo: int) -> torch.Tensor:
        """(Q, 1, stop - lo) 0 where a query sees the window row, -inf where not (shared by
        every block of the same offsets)."""
        key = (start - lo, stop - start)
        if key not in self._window_bias:
            dev = self.kv.device
            lag = torch.arange(start, stop, device=dev)[:, None] - torch.arange(
                lo, stop, device=dev
            )
            self._window_bias[key] = _bias((lag >= 0) & (lag < self.window)).unsqueeze(1)
        return self._window_bias[key]

    def entry_bias(self, start: int, stop: int) -> torch.Tensor:
        """(B or 1, Q, 1, W) 0 where a query sees the entry, -inf where not."""
        n, dev = self.entries.shape[1], self.kv.device
        if self.picks is None:
            pos = torch.arange(start + 1, stop + 1, device=dev)
            return _bias(torch.arange(n, device=dev) < (pos // self.rate)[:, None])[None, :, None]
        idx, pick_bias = self.picks[0][:, start:stop], self.picks[1][:, start:stop]
        bias = torch.full((*idx.shape[:2], n), float("-inf"), device=dev)
        return bias.scatter_(-1, idx, pick_bias).unsqueeze(2)

    def probs(
        self, q_BQHK: torch.Tensor, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """fp32 probabilities (B, Q H, T + 1) of the block's queries (already scaled), the sink's
        last; its keys and ``lo``."""
        b, q, h, k = q_BQHK.shape
        keys, lo = self.keys(start, stop)
        t = keys.shape[1]
        logits = q_BQHK.new_empty(b, q * h, t + 1, dtype=torch.float32)
        torch.bmm(q_BQHK.reshape(b, q * h, k).float(), keys.transpose(1, 2), out=logits[..., :t])
        by_head = logits.view(b, q, h, t + 1)
        by_head[..., : stop - lo].add_(self.window_bias(start, stop, lo))
        if t > stop - lo:
            by_head[..., stop - lo : t].add_(self.entry_bias(start, stop))
        by_head[..., t] = self.sinks
        return torch.softmax(logits, dim=-1), keys, lo


class _WindowEntryAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, entries, idx, valid, sinks, window, rate, scale):  # noqa: ANN001, ANN205
        b, s, h, k = q.shape
        q_scaled = q * scale
        blocks = _Blocks(kv, entries, idx, valid, sinks, window, rate)
        out = q.new_empty(b, s, h, k, dtype=torch.float32)
        for start in range(0, s, BLOCK):
            stop = min(s, start + BLOCK)
            p, keys, _ = blocks.probs(q_scaled[:, start:stop], start, stop)
            torch.bmm(p[..., :-1], keys, out=out[:, start:stop].view(b, -1, k))
        out = out.to(q.dtype)
        ctx.save_for_backward(q_scaled, kv, entries, idx, valid, sinks, out)
        ctx.window, ctx.rate, ctx.scale = window, rate, scale
        return out

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        q_scaled, kv, entries, idx, valid, sinks, out = ctx.saved_tensors
        blocks = _Blocks(kv, entries, idx, valid, sinks, ctx.window, ctx.rate)
        b, s, h, k = q_scaled.shape
        tw = kv.shape[1]
        d_out = d_out.float().contiguous()
        delta = (d_out * out.float()).sum(-1, keepdim=True).view(b, s * h, 1)  # (B, S H, 1)
        dq = q_scaled.new_empty(b, s, h, k, dtype=torch.float32)
        d_keys_all = q_scaled.new_zeros(b, tw + entries.shape[1], k, dtype=torch.float32)
        d_sinks = torch.zeros(h, dtype=torch.float32, device=q_scaled.device)
        for start in range(0, s, BLOCK):
            stop = min(s, start + BLOCK)
            q_blk = q_scaled[:, start:stop]
            p, keys, lo = blocks.probs(q_blk, start, stop)
            t = keys.shape[1]
            do = d_out[:, start:stop].view(b, -1, k)
            d_logits = torch.empty_like(p)  # dP, then the logits' gradient (sink's last)
            torch.bmm(do, keys.transpose(1, 2), out=d_logits[..., :t])
            d_logits[..., t] = 0.0
            d_logits.sub_(delta[:, start * h : stop * h]).mul_(p)
            d_sinks += d_logits[..., t].view(b, -1, h).sum((0, 1))
            dl = d_logits[..., :t]
            torch.baddbmm(
                dq[:, start:stop].view(b, -1, k),
                dl,
                keys,
                beta=0,
                alpha=ctx.scale,
                out=dq[:, start:stop].view(b, -1, k),
            )
            d_keys = torch.bmm(dl.transpose(1, 2), q_blk.reshape(b, -1, k).float())
            d_keys.baddbmm_(p[..., :t].transpose(1, 2), do)  # (B, T, K)
            d_keys_all[:, lo:stop] += d_keys[:, : stop - lo]
            d_keys_all[:, tw:] += d_keys[:, stop - lo :]
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
    sinks = torch.full((h,), float("-inf"), device=q_BSHK.device)
    blocks = _Blocks(kv_BSK, entries_BWK, idx, valid, sinks, window, rate)
    out = torch.full((h,), float("-inf"), device=q_BSHK.device)
    for start in range(0, s, BLOCK):
        stop = min(s, start + BLOCK)
        q_blk = q_BSHK[:, start:stop].float() * scale
        keys, lo = blocks.keys(start, stop)
        logits = torch.bmm(q_blk.reshape(b, -1, q_blk.shape[-1]), keys.transpose(1, 2))
        by_head = logits.view(b, stop - start, h, -1)
        by_head[..., : stop - lo] += blocks.window_bias(start, stop, lo)
        if keys.shape[1] > stop - lo:
            by_head[..., stop - lo :] += blocks.entry_bias(start, stop)
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
