"""Mamba-2's selective state-space scan (Dao & Gu 2024): the chunked state-space-duality (SSD)
form for training and prefill, with a hand-written backward, and the token recurrence it
equals, for reference and decoding.

Shape legend: B batch, S sequence, H heads, P head dim, G groups (head h reads group
h // (H / G)), r = H / G heads per group, N state dim, Q chunk length.

Per head, with a = dt * A (A < 0, dt > 0 the step size of the token) and the state h (P, N):

    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T          y_t = h_t C_t + D x_t

The chunked form runs over the chunks in order. In a chunk, with ``cum`` the cumulative sum of
a from its start, ``L[l, s] = exp(cum_l - cum_s)``, the scores ``C B^T`` zero unless s <= l in
one document, and ``xdt = dt x``:

    y   = (C B^T * L) xdt + exp(cum) (C h^T) + D x       h the state entering the chunk
    h'  = exp(cum_Q) h + (xdt * exp(cum_Q - cum))^T B    the state leaving it

exact (the same sums in another order). The decays are differences of cumulative sums taken in
fp64 (in fp32 they would lose ~1e-7 of the chunk's total decay), every product in fp32 or
wider; a decay below e^20 times the dtype's smallest normal number reads as that floor (far
below any rounding of the sums it enters; no subnormal number slows the products). The forward
keeps only its inputs and the states entering the chunks; the backward recomputes a chunk's
(Q, Q) decays and scores from them and runs the chunks in reverse, so no (Q, Q) tensor
outlives its chunk.

Packed documents: a document start drops the state before it (the position's own input is
kept), so a packed row computes what its documents compute one by one: the scores are zero
across a start, the entering state reaches only the positions before the chunk's first start,
only the chunk's last document reaches h', and a chunk with a start passes no earlier state on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

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
    b, s = x.shape[:2]
    _check(x, dt, A, B, C, initial_state, chunk_size)
    starts = document_starts(doc_ids, None, b, s)
    y, state = ChunkedSSD.apply(x, dt, A, B, C, D, initial_state, starts, chunk_size)
    return y, state if output_final_state else None


@dataclass
class _Chunk:
    """One chunk of the scan, computed from the inputs alike by the forward and the backward:
    per head grouped (B, G, r, q, *), B and C (B, G, 1, q, N)."""

    x: torch.Tensor  # (B, G, r, q, P)
    dt: torch.Tensor  # (B, G, r, q)
    xdt: torch.Tensor  # dt x
    B: torch.Tensor
    C: torch.Tensor
    L: torch.Tensor  # (B, G, r, q, q) exp(cum_l - cum_s) where s <= l (1 above the diagonal)
    drop: torch.Tensor  # (q, q) or (B, 1, 1, q, q) bool: not s <= l in one document
    CB: torch.Tensor  # (B, G, 1, q, q) C B^T, zero where ``drop``
    f: torch.Tensor  # (B, G, r, q) exp(cum): the entering state's decay, up to the first start
    w: torch.Tensor  # exp(cum_Q - cum): a token's decay to the chunk's end, its last document
    carry: torch.Tensor  # (B, G, r) exp(cum_Q), zero where the chunk holds a start


def _chunk(x, dt, A, B, C, seg, i: int, j: int) -> _Chunk:
    """Positions i..j-1 (``seg`` (B, S) each position's document number, or None)."""
    b, _, h, p = x.shape
    g, q = B.shape[2], j - i
    r = h // g
    wide = torch.promote_types(x.dtype, torch.float32)
    xc = x[:, i:j].to(wide).view(b, q, g, r, p).permute(0, 2, 3, 1, 4)
    dtc = dt[:, i:j].to(wide).view(b, q, g, r).permute(0, 2, 3, 1)
    Bc = B[:, i:j].to(wide).transpose(1, 2).unsqueeze(2)
    Cc = C[:, i:j].to(wide).transpose(1, 2).unsqueeze(2)
    cum = (dtc * A.to(wide).view(g, r, 1)).to(torch.float64).cumsum(-1)
    drop = torch.ones(q, q, dtype=torch.bool, device=x.device).triu_(1)
    f, w, carry = (_exp(t.to(wide, copy=True)) for t in (cum, cum[..., -1:] - cum, cum[..., -1]))
    if seg is not None:
        sc = seg[:, i:j]
        prev = seg[:, max(i - 1, 0), None]  # the document entering the chunk
        drop = drop | (sc[:, :, None] != sc[:, None, :])[:, None, None]
        f = f * (sc == prev)[:, None, None]
        w = w * (sc == sc[:, -1:])[:, None, None]
        carry = carry * (sc[:, -1:] == prev)[:, None]
    L = torch.sub(
        cum[..., :, None], cum[..., None, :], out=cum.new_empty(*cum.shape, q, dtype=wide)
    )
    cb = (Cc @ Bc.mT).masked_fill_(drop, 0.0)
    return _Chunk(xc, dtc, xc * dtc[..., None], Bc, Cc, _exp(L), drop, cb, f, w, carry)


def _exp(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp`` in place of log decays, clamped to [e^20 times the dtype's smallest normal
    number, 1]: a decay below that floor (5e-30 in fp32) reads as the floor, far below any
    rounding of the sums it enters (:func:`moetrain.model.decayed_products.decay_exp` flushes it
    to 0 instead: subnormal numbers slow every product they enter a hundredfold on CPUs), and
    a positive exponent (above the diagonal, where the scores are zero) as 1, without taking
    ``exp`` of what underflows or overflows (slow paths on CPUs)."""
    cut = math.log(torch.finfo(log_decay.dtype).tiny) + 20.0
    return log_decay.clamp_(cut, 0.0).exp_()


class ChunkedSSD(torch.autograd.Function):
    """(y, final state) of the scan over chunks of ``q`` (the module docstring); inputs as
    :func:`ssd_scan` takes them, already checked, ``starts`` (B, S) bool or None."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, h0, starts, q: int):
        b, s, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        r, wide = h // g, torch.promote_types(x.dtype, torch.float32)
        seg = None if starts is None else starts.long().cumsum(1)  # document numbers
        y = x.new_empty(b, s, h, p, dtype=wide)
        state = x.new_zeros(b, g, r, p, n, dtype=wide) if h0 is None else h0.to(wide)
        state = state.view(b, g, r, p, n)
        entering = x.new_empty(-(-s // q), b, g, r, p, n, dtype=wide)
        for c, i in enumerate(range(0, s, q)):
            k = _chunk(x, dt, A, B, C, seg, i, min(i + q, s))
            entering[c] = state
            yc = k.L.mul_(k.CB) @ k.xdt + (k.C @ state.mT) * k.f[..., None]
            if D is not None:
                yc += k.x * D.to(wide).view(g, r, 1, 1)
            y[:, i : i + q].unflatten(2, (g, r)).copy_(yc.permute(0, 3, 1, 2, 4))
            state = (k.xdt * k.w[..., None]).mT @ k.B + k.carry[..., None, None] * state
        ctx.save_for_backward(x, dt, A, B, C, D, h0, starts, entering)
        ctx.q = q
        return y, state.reshape(b, h, p, n)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dstate):
        x, dt, A, B, C, D, h0, starts, entering = ctx.saved_tensors
        b, s, h, p = x.shape
        g, q, wide = B.shape[2], ctx.q, entering.dtype
        r = h // g
        seg = None if starts is None else starts.long().cumsum(1)  # document numbers
        dx = x.new_empty(b, s, h, p, dtype=wide)
        ddt = x.new_empty(b, s, h, dtype=wide)
        dB, dC = x.new_empty(B.shape, dtype=wide), x.new_empty(C.shape, dtype=wide)
        dA, dD = x.new_zeros(g, r, dtype=wide), x.new_zeros(g, r, dtype=wide)
        d = dstate.to(wide).reshape(entering[0].shape)  # the gradient of the state leaving a chunk
        Ag = A.to(wide).view(g, r, 1)
        for c, i in reversed(list(enumerate(range(0, s, q)))):
            j = min(i + q, s)
            k, h_in = _chunk(x, dt, A, B, C, seg, i, j), entering[c]
            dyc = dy[:, i:j].to(wide).unflatten(2, (g, r)).permute(0, 2, 3, 1, 4)
            m = k.CB * k.L
            dxdt = m.mT @ dyc
            dm_l = (dyc @ k.xdt.mT).mul_(k.L)  # the scores' gradient times their decay
            e = dm_l * k.CB  # the decays' gradient times the decays
            dcum = e.sum(-1) - e.sum(-2)
            dcb = dm_l.sum(2, keepdim=True).masked_fill_(k.drop, 0.0)
            dch = dyc @ h_in  # (B, G, r, q, N)
            dCc = dcb @ k.B + (dch * k.f[..., None]).sum(2, keepdim=True)
            dcum += (dch * k.C).sum(-1) * k.f
            dw = k.B @ d.mT  # (B, G, r, q, P) the gradient of xdt * w
            dxdt += dw * k.w[..., None]
            wg = (dw * k.xdt).sum(-1) * k.w
            dBc = dcb.mT @ k.C + ((k.xdt * k.w[..., None]) @ d).sum(2, keepdim=True)
            dcum -= wg
            dcum[..., -1] += wg.sum(-1) + (d * h_in).sum((-1, -2)) * k.carry
            d = (dyc * k.f[..., None]).mT @ k.C + k.carry[..., None, None] * d
            da = dcum.to(torch.float64).flip(-1).cumsum(-1).flip(-1).to(wide)
            dxc = dxdt * k.dt[..., None]
            if D is not None:
                dxc += dyc * D.to(wide).view(g, r, 1, 1)
                dD += (dyc * k.x).sum((0, 3, 4))
            dA += (da * k.dt).sum((0, 3))
            dx[:, i:j].unflatten(2, (g, r)).copy_(dxc.permute(0, 3, 1, 2, 4))
            ddtc = (dxdt * k.x).sum(-1) + da * Ag
            ddt[:, i:j].unflatten(2, (g, r)).copy_(ddtc.permute(0, 3, 1, 2))
            dB[:, i:j] = dBc.squeeze(2).transpose(1, 2)
            dC[:, i:j] = dCc.squeeze(2).transpose(1, 2)
        return (
            dx.to(x.dtype),
            ddt.to(dt.dtype),
            dA.view(h).to(A.dtype),
            dB.to(B.dtype),
            dC.to(C.dtype),
            None if D is None else dD.view(h).to(D.dtype),
            None if h0 is None else d.reshape(h0.shape).to(h0.dtype),
            None,
            None,
        )


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
