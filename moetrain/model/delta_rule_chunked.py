"""The chunked gated delta rule (WY / UT transform) with a hand-written backward.

Shape legend: B batch, S sequence, Hk query/key heads, H value heads (a multiple of Hk),
K key dim, V value dim, N chunks, C chunk length (S padded to N * C), G the decay's channels
(1 per head, K per key channel). Inside, tensors are (N, B, H, C, *) in fp32 (fp64 for fp64
inputs), queries and keys repeated to H heads.

One chunk, state ``h`` (K, V) entering it, ``gam`` the cumulative log decay from the chunk's
start (``E = exp(gam)``, ``gam_C`` its last row), documents as masks (``r``: no document starts
between the chunk's start and t; ``e``: t is in the chunk's last document; ``rC``: no start in
the chunk; ``keep``: i <= t in one document):

    A = beta * prod(k, k)         strictly lower (:mod:`moetrain.model.decayed_products`)
    P = prod(q, k)                lower
    T = (I + A)^-1                the UT transform
    U = T (beta * v - (beta * k * E * r) h)      the values each token writes (the deltas)
    O = (q * E * r) h + P U
    h' = exp(gam_C) rC h + (k * exp(gam_C - gam) * e)^T U

which is the recurrence summed in closed form: U_t = beta_t (v_t - k_t^T S'_t) with S'_t the
decayed state before token t. Only the two products with ``h`` are sequential; the rest is
batched over all chunks. Forward saves T, P, U and the chunk-start states ``h``; the backward
recomputes the elementwise terms and runs the chunks in reverse (``dX = T^T dU``,
``dA = -dX U^T``, ``dh = (q E r)^T dO + exp(gam_C) rC dh' - (beta k E r)^T dX``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from moetrain.model.decayed_products import (
    decay_exp,
    decay_grad,
    decayed_products,
    decayed_products_grad,
    pair_decay,
)


def to_chunks(x: torch.Tensor, c: int, dtype: torch.dtype, rep: int = 1) -> torch.Tensor:
    """(B, S, Hx, *F) -> (N, B, Hx * rep, C, *F) in ``dtype``, zero-padded to N * C positions,
    head h of the result being head h // rep of ``x`` (one copy)."""
    b, s, hx, *f = x.shape
    n, full = -(-s // c), s // c
    alloc = x.new_empty if n == full else x.new_zeros  # only the padding needs zeros
    out = alloc((n, b, hx, rep, c, *f), dtype=dtype)
    src = x.unsqueeze(3)
    feat = tuple(range(4, 4 + len(f)))
    if full:
        blocks = src[:, : full * c].unflatten(1, (full, c))
        out[:full] = blocks.permute(1, 0, 3, 4, 2, *(i + 1 for i in feat))
    if s > full * c:
        out[full, :, :, :, : s - full * c] = src[:, full * c :].permute(0, 2, 3, 1, *feat)
    return out.view(n, b, hx * rep, c, *f)


def from_chunks(y: torch.Tensor, s: int, dtype: torch.dtype, rep: int = 1) -> torch.Tensor:
    """(N, B, H, C, *F) -> (B, S, H / rep, *F) in ``dtype``, each group of ``rep`` heads summed."""
    n, b, h, c, *f = y.shape
    if rep > 1:
        y = y.view(n, b, h // rep, rep, c, *f).sum(3)
    y = y.movedim(0, 1).movedim(3, 2).reshape(b, n * c, h // rep, *f)
    return y[:, :s].to(dtype).contiguous()


@dataclass
class _Chunked:
    """What the forward and the backward both compute from the inputs (the factors are
    (N, B, H, C, G): small under a per-head decay)."""

    q: torch.Tensor  # (N, B, H, C, K), scaled
    k: torch.Tensor
    bk: torch.Tensor  # beta * k
    beta: torch.Tensor  # (N, B, H, C, 1)
    gam: torch.Tensor  # (N, B, H, C, G): cumulative log decay from the chunk's start
    er: torch.Tensor  # exp(gam) * r: how much of the chunk-start state reaches t
    fd: torch.Tensor  # exp(gam_C - gam) * e: how much of token t reaches the chunk-end state
    lam: torch.Tensor  # (N, B, H, G, 1): exp(gam_C) * rC, the chunk-start state's decay over it
    keep: torch.Tensor  # (C, C) or (N, B, 1, C, C): i <= t within one document
    strict: torch.Tensor  # i < t within one document
    decay: torch.Tensor | None = None  # (N, B, H, C, C): pair_decay, per-head decays only

    def at(self, n: int) -> _Chunked:
        """Chunk ``n`` alone (every tensor (B, H, C, *))."""
        per_chunk = self.keep.dim() > 2
        return _Chunked(
            *(getattr(self, f)[n] for f in ("q", "k", "bk", "beta", "gam", "er", "fd", "lam")),
            self.keep[n] if per_chunk else self.keep,
            self.strict[n] if per_chunk else self.strict,
            None if self.decay is None else self.decay[n],
        )


def _document_masks(starts: torch.Tensor | None, n: int, c: int, dev: torch.device):
    """(r, e, rC, keep, strict) for ``starts`` (B, S) bool; r, e, rC None without documents."""
    tril = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
    if starts is None:
        return None, None, None, tril, tril.tril(-1)
    b, s = starts.shape
    seg = starts.long().cumsum(1) - starts[:, :1].long()  # position 0 never restarts
    seg = torch.cat([seg, seg[:, -1:].expand(b, n * c - s)], 1).view(b, n, c).transpose(0, 1)
    before = torch.cat([seg[:1, :, :1], seg[:-1, :, -1:]])  # the segment entering each chunk
    r = (seg == before)[:, :, None, :, None]
    e = (seg == seg[..., -1:])[:, :, None, :, None]
    same = (seg.unsqueeze(-1) == seg.unsqueeze(-2)).unsqueeze(2)
    return r, e, r[..., -1:, :], same & tril, same & tril.tril(-1)


def _prepare(q, k, g, beta, starts, c: int, scale: float, dt: torch.dtype) -> _Chunked:
    rep = beta.shape[2] // k.shape[2]
    qc = to_chunks(q, c, dt, rep).mul_(scale)
    kc = to_chunks(k, c, dt, rep)
    bc = to_chunks(beta, c, dt).unsqueeze(-1)
    gam = to_chunks(g, c, dt)
    gam = (gam.unsqueeze(-1) if g.dim() == 3 else gam).cumsum_(3)
    r, e, rc, keep, strict = _document_masks(starts, qc.shape[0], c, qc.device)
    last = gam[..., -1:, :]
    er, fd, lam = decay_exp(gam.clone()), decay_exp(last - gam), decay_exp(last.clone()).mT
    if r is not None:
        er, fd, lam = er * r, fd * e, lam * rc
    return _Chunked(qc, kc, kc * bc, bc, gam, er, fd, lam, keep, strict)


def _pair_decay(x: _Chunked) -> torch.Tensor | None:
    """The factor every product of a chunk shares under a per-head decay (one computation for
    all of them); None per key channel."""
    return pair_decay(x.gam, x.keep) if x.gam.shape[-1] == 1 else None


def _z(x: torch.Tensor) -> torch.Tensor:
    """(..., R, X) -> (Z, R, X), a view: the batch of matrices ``torch.bmm`` takes."""
    return x.view(-1, *x.shape[-2:])


class ChunkedGatedDelta(torch.autograd.Function):
    """(o, final state) of the gated delta rule over chunks of ``c`` (the module docstring).
    Inputs as :func:`moetrain.model.delta_rule.gated_delta_rule` takes them, already checked,
    ``starts`` (B, S) bool or None, ``h0`` (B, H, K, V) or None."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, starts, c: int, scale: float):
        dt = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
        x = _prepare(q, k, g, beta, starts, c, scale, dt)
        u = to_chunks(v, c, dt).mul_(x.beta)
        d = _pair_decay(x)
        a = decayed_products(x.bk, x.k, x.gam, x.keep, d)
        p = decayed_products(x.q, x.k, x.gam, x.keep, d)
        del d
        eye = torch.eye(c, dtype=dt, device=v.device)
        t = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        del a
        w = t @ (x.bk * x.er)
        u = t @ u  # T beta v; the scan subtracts W h in place
        b, _, h, dv = v.shape
        state = v.new_zeros((b, h, k.shape[-1], dv), dtype=dt) if h0 is None else h0.to(dt)
        hs = u.new_empty(*u.shape[:3], k.shape[-1], dv)
        kd = x.k * x.fd
        for n in range(u.shape[0]):
            hs[n] = state
            un = _z(u[n])
            torch.baddbmm(un, _z(w[n]), _z(state), alpha=-1, out=un)
            state = torch.baddbmm(_z(state * x.lam[n]), _z(kd[n]).mT, un).view_as(state)
        del w, kd
        o = torch.baddbmm(_z(x.q * x.er) @ _z(hs), _z(p), _z(u)).view_as(u)
        ctx.save_for_backward(q, k, v, g, beta, h0, starts, hs, u, t, p)
        ctx.c, ctx.scale = c, scale
        return from_chunks(o, v.shape[1], v.dtype), state

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dstate):
        q, k, v, g, beta, h0, starts, hs, u, t, p = ctx.saved_tensors
        c, scale, dt = ctx.c, ctx.scale, hs.dtype
        x = _prepare(q, k, g, beta, starts, c, scale, dt)
        x.decay = _pair_decay(x)
        doc, vc = to_chunks(do, c, dt), to_chunks(v, c, dt)
        dq, dk, dv = torch.empty_like(x.q), torch.empty_like(x.k), torch.empty_like(u)
        dbeta, dg = torch.empty_like(x.beta), torch.empty_like(x.gam)
        d = torch.zeros_like(hs[0]) if dstate is None else dstate.to(dt)
        for n in reversed(range(u.shape[0])):  # d: the gradient of chunk n's end state
            grads, d = _chunk_backward(x.at(n), doc[n], vc[n], hs[n], u[n], t[n], p[n], d)
            dq[n], dk[n], dv[n], dbeta[n], dg[n] = grads
        s, rep = v.shape[1], v.shape[2] // k.shape[2]
        return (
            from_chunks(dq.mul_(scale), s, q.dtype, rep),
            from_chunks(dk, s, k.dtype, rep),
            from_chunks(dv, s, v.dtype),
            from_chunks(dg if g.dim() == 4 else dg.squeeze(-1), s, g.dtype),
            from_chunks(dbeta.squeeze(-1), s, beta.dtype),
            None if h0 is None else d.to(h0.dtype),
            None,
            None,
            None,
        )


def _chunk_backward(x: _Chunked, do, v, h, u, t, p, d):
    """One chunk's input gradients (dq unscaled, dk, dv, dbeta, dg) and the gradient of its
    start state, from ``do`` (B, H, C, V) and ``d``, the gradient of its end state; every
    tensor is the chunk's (B, H, C, *)."""
    kd, qd, kb = x.k * x.fd, x.q * x.er, x.bk * x.er
    dx = t.mT @ (p.mT @ do + kd @ d)
    dqd, dkd, dkb = do @ h.mT, u @ d.mT, (dx @ h.mT).neg_()
    dlam = (h * d).sum(-1, keepdim=True)
    ch = x.gam.shape[-1]
    if ch == 1:
        dlam = dlam.sum(-2, keepdim=True)
    d_start = d * x.lam + qd.mT @ do - kb.mT @ dx
    dp = (do @ u.mT).mul_(x.keep)  # (a multiply by the mask: a masked fill costs far more)
    da = (dx @ u.mT).mul_(x.strict).neg_()
    dxp, dyp = decayed_products_grad(x.q, x.k, x.gam, x.keep, dp, x.decay)
    dxa, dya = decayed_products_grad(x.bk, x.k, x.gam, x.keep, da, x.decay)
    dgam = decay_grad(
        (qd, dqd),
        (kb, dkb),
        (-kd, dkd),
        (x.bk, dxa),
        (-x.k, dya),
        (x.q, dxp),
        (-x.k, dyp),
        channels=ch,
    )
    dgam[..., -1:, :] += decay_grad((kd, dkd), channels=ch).sum(-2, keepdim=True)
    dgam[..., -1:, :] += (x.lam * dlam).mT
    dbk = dkb.mul_(x.er).add_(dxa)
    dk = dbk * x.beta + dkd.mul_(x.fd) + dya + dyp
    dq = dqd.mul_(x.er).add_(dxp)
    dbeta = (v * dx).sum(-1, keepdim=True) + (dbk * x.k).sum(-1, keepdim=True)
    dg = dgam.flip(-2).cumsum(-2).flip(-2)
    return (dq, dk, dx.mul_(x.beta), dbeta, dg), d_start
