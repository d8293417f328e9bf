"""Mamba-2's selective state-space scan (Dao & Gu 2024): the chunked state-space-duality (SSD)
form for training and prefill, and the token recurrence it equals, for reference and decoding.

Shape legend: B batch, S sequence, H heads, P head dim, G groups (head h reads group
h // (H / G)), N state dim, Q chunk length, c chunks.

Per head, with a = dt * A (A < 0, dt > 0 the step size of the token) and the state h (P, N):

    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T          y_t = h_t C_t + D x_t

The chunked form computes, per chunk, the outputs within it as a masked "attention"
``(C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s``, the state at its end from its tokens, and
carries the states from chunk to chunk; it is exact (the same sums in another order). The
decay between two positions of a chunk is a difference of its cumulative sums taken in fp64 (in
fp32 it would lose ~1e-7 of the chunk's total decay), every product in fp32 or wider.

Packed documents: a document start drops the state before it (the position's own input is
kept), so a packed row computes what its documents compute one by one: decays that cross a
start are zero within a chunk, and a chunk with a start passes no earlier state on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.model.document_starts import document_starts


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    chunk_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y (B, S, H, P) in fp32 (or fp64 for fp64 inputs) and, with ``output_final_state``, the
    state (B, H, P, N), for x (B, S, H, P), dt (B, S, H) (after its bias, softplus and limits),
    A (H,) (negative), B and C (B, S, G, N), D (H,) (the skip; None: none), ``initial_state``
    (B, H, P, N) and ``doc_ids`` (B, S) (the module docstring)."""
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _check(x, dt, A, B, C, initial_state, chunk_size)
    wide = torch.promote_types(x.dtype, torch.float32)
    starts = document_starts(doc_ids, None, b, s)
    q = chunk_size
    pad = (-s) % q
    nc = (s + pad) // q
    x_, dt_ = x.to(wide), dt.to(wide)
    a = dt_ * A.to(wide)  # (B, S, H)
    xdt = x_ * dt_[..., None]
    Bw, Cw = B.to(wide), C.to(wide)
    if pad:
        xdt, a = F.pad(xdt, (0, 0, 0, 0, 0, pad)), F.pad(a, (0, 0, 0, pad))
        Bw, Cw = F.pad(Bw, (0, 0, 0, 0, 0, pad)), F.pad(Cw, (0, 0, 0, 0, 0, pad))
    seg = _segments(starts, b, s + pad, x.device)  # (B, S) document number in the row
    # chunks: (B, c, Q, ...); heads of a group together: (B, c, Q, G, r, ...)
    r = h // g
    xdt = xdt.view(b, nc, q, g, r, p)
    a = a.view(b, nc, q, g, r).permute(0, 1, 3, 4, 2)  # (B, c, G, r, Q)
    Bw, Cw = Bw.view(b, nc, q, g, n), Cw.view(b, nc, q, g, n)
    seg = seg.view(b, nc, q)
    keep = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()  # causal
    if starts is not None:  # and l, s in one document
        keep = (seg[:, :, :, None] == seg[:, :, None, :]) & keep  # (B, c, Q, Q)
        keep = keep[:, :, None, None]
    # decay from s to l: the sum of a over s+1..l, a difference of cumulative sums taken in
    # fp64 (exact to ~1e-16 of the chunk's total, where fp32 would lose ~1e-7 of it)
    total = a.to(torch.float64).cumsum(-1)
    segsum = (total[..., :, None] - total[..., None, :]).to(wide)
    decay = segsum.masked_fill(~keep, float("-inf")).exp()  # (B, c, G, r, Q, Q)
    # within each chunk: y_l = sum_s (C_l . B_s) decay(s -> l) dt_s x_s
    Bg, Cg = Bw.transpose(2, 3)[:, :, :, None], Cw.transpose(2, 3)[:, :, :, None]  # (B,c,G,1,Q,N)
    xdt = xdt.permute(0, 1, 3, 4, 2, 5)  # (B, c, G, r, Q, P)
    y = ((Cg @ Bg.transpose(-1, -2)) * decay) @ xdt
    # each chunk's own state at its end: its last document's tokens, decayed to the end
    own = (xdt * decay[..., -1, :, None]).transpose(-1, -2) @ Bg  # (B, c, G, r, P, N)
    # the states entering each chunk, chunk by chunk: a chunk with a start passes only its
    # own on
    whole = a.sum(-1).exp()  # (B, c, G, r) the decay across a chunk
    last = torch.cat([seg[:, :1, 0], seg[:, :-1, -1]], dim=1)  # the document before each chunk
    passes = (seg[:, :, -1] == last).to(wide)  # (B, c) no start in the chunk
    state = (
        x_.new_zeros(b, g, r, p, n)
        if initial_state is None
        else initial_state.to(wide).view(b, g, r, p, n)
    )
    entering = []
    for c in range(nc):
        entering.append(state)
        carry = (whole[:, c] * passes[:, c, None, None])[..., None, None]
        state = carry * state + own[:, c]
    entering = torch.stack(entering, 1)  # (B, c, G, r, P, N)
    # the entering state's part of each output, decayed from the chunk's start, up to the
    # chunk's first start
    before = (seg == last[:, :, None]).to(wide)[:, :, None, None, :]  # (B, c, 1, 1, Q)
    from_start = a.cumsum(-1).exp() * before  # (B, c, G, r, Q)
    y = y + (Cg @ entering.transpose(-1, -2)) * from_start[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5)  # (B, c, Q, G, r, P)
    y = y.reshape(b, s + pad, h, p)[:, :s]
    if D is not None:
        y = y + x_ * D.to(wide)[:, None]
    return y, state.reshape(b, h, p, n) if output_final_state else None


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same as :func:`ssd_scan`, one token at a time (the definition; a decode step)."""
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _check(x, dt, A, B, C, initial_state, 1)
    wide = torch.promote_types(x.dtype, torch.float32)
    starts = document_starts(doc_ids, None, b, s)
    r = h // g
    state = x.new_zeros(b, h, p, n, dtype=wide) if initial_state is None else initial_state.to(wide)
    Bh = B.to(wide).repeat_interleave(r, dim=2)  # (B, S, H, N)
    Ch = C.to(wide).repeat_interleave(r, dim=2)
    x_, dt_ = x.to(wide), dt.to(wide)
    outs = []
    for t in range(s):
        decay = (dt_[:, t] * A.to(wide)).exp()  # (B, H)
        if starts is not None:
            decay = decay * (~starts[:, t]).to(wide)[:, None]
        write = (dt_[:, t, :, None] * x_[:, t])[..., None] * Bh[:, t, :, None, :]
        state = decay[..., None, None] * state + write
        outs.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(outs, 1)
    if D is not None:
        y = y + x_ * D.to(wide)[:, None]
    return y, state if output_final_state else None


def _segments(
    starts: torch.Tensor | None, batch: int, length: int, device: torch.device
) -> torch.Tensor:
    """(B, length) each position's document number in its row (0 before any start; padding
    continues the last document)."""
    seg = torch.zeros(batch, length, dtype=torch.long, device=device)
    if starts is not None:
        seg[:, : starts.shape[1]] = starts.long().cumsum(1)
        seg[:, starts.shape[1] :] = seg[:, starts.shape[1] - 1 : starts.shape[1]]
    return seg


def _check(x, dt, A, B, C, initial_state, chunk_size) -> None:
    """Refuse shapes that do not fit, by the tensor's name."""
    if x.dim() != 4:
        raise ValueError(f"x must be (B, S, H, P); got shape {tuple(x.shape)}")
    b, s, h, p = x.shape
    if tuple(dt.shape) != (b, s, h):
        raise ValueError(f"dt must be (B, S, H) = {(b, s, h)}; got {tuple(dt.shape)}")
    if tuple(A.shape) != (h,):
        raise ValueError(f"A must be (H,) = ({h},); got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (b, s) or h % B.shape[2] or B.shape != C.shape:
        raise ValueError(
            f"B and C must be (B, S, G, N) with H = {h} a multiple of G; got "
            f"{tuple(B.shape)} and {tuple(C.shape)}"
        )
    if initial_state is not None and tuple(initial_state.shape) != (b, h, p, B.shape[3]):
        raise ValueError(
            f"initial_state must be (B, H, P, N) = {(b, h, p, B.shape[3])}; got "
            f"{tuple(initial_state.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
