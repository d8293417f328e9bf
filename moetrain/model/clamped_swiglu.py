"""The clamped SwiGLU (``moe.activation`` / ``model.ffn_activation: clamped_swiglu``; gpt-oss,
DeepSeek-V4): with ``a' = min(a, limit)`` and ``b' = clamp(b, -limit, limit)``,
``(b' + offset) * a' * sigmoid(alpha * a')``, the clamps passing no gradient where they bind.
Written out forward and backward (saving the inputs only), on a packed ``[a | b]`` with a
per-row weight (the experts) or on two separate halves (the shared expert and dense FFN)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moetrain.model.row_blocks import row_blocks


class _ClampedSwiGLUPacked(torch.autograd.Function):
    """:func:`clamped_swiglu_packed` with its gradient written out: saves h and w only (autograd's
    composition keeps five (..., F) temporaries) and writes the gradient wrt h into one packed
    buffer. The math runs in the wider of h's and w's dtypes, a block of rows at a time
    (:func:`_clamped_swiglu_rows`, :func:`_clamped_swiglu_grad_rows`)."""

    @staticmethod
    def forward(ctx, h, w, alpha, limit, offset):  # noqa: ANN001, ANN205
        ctx.save_for_backward(h, w)
        ctx.clamp = alpha, limit, offset
        wide = h.dtype if w is None else torch.promote_types(h.dtype, w.dtype)
        out = h.new_empty(*h.shape[:-1], h.shape[-1] // 2)
        for rows in row_blocks(h):
            w_rows = None if w is None else w[rows]
            _clamped_swiglu_rows(*h[rows].to(wide).chunk(2, -1), w_rows, ctx.clamp, out[rows])
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        h, w = ctx.saved_tensors
        wide = h.dtype if w is None else torch.promote_types(h.dtype, w.dtype)
        grad_h = torch.empty_like(h)
        need_w = w is not None and ctx.needs_input_grad[1]
        grad_w = torch.empty_like(w) if need_w else None
        for rows in row_blocks(h):
            a, b = h[rows].to(wide).chunk(2, -1)
            w_rows = None if w is None else w[rows]
            gw = _clamped_swiglu_grad_rows(
                grad[rows].to(wide), a, b, w_rows, ctx.clamp, *grad_h[rows].chunk(2, -1), need_w
            )
            if need_w:
                grad_w[rows] = gw
        return grad_h, grad_w, None, None, None


class _ClampedSwiGLU(torch.autograd.Function):
    """:func:`clamped_swiglu` of two separate (..., F) tensors, unweighted: as
    :class:`_ClampedSwiGLUPacked`, with a gradient per input (no packed copy either way)."""

    @staticmethod
    def forward(ctx, a, b, alpha, limit, offset):  # noqa: ANN001, ANN205
        ctx.save_for_backward(a, b)
        ctx.clamp = alpha, limit, offset
        out = torch.empty_like(a)
        for rows in row_blocks(a):
            _clamped_swiglu_rows(a[rows], b[rows], None, ctx.clamp, out[rows])
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        a, b = ctx.saved_tensors
        grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
        for rows in row_blocks(a):
            _clamped_swiglu_grad_rows(
                grad[rows], a[rows], b[rows], None, ctx.clamp, grad_a[rows], grad_b[rows], False
            )
        return grad_a, grad_b, None, None, None


Clamp = tuple[float, float, float]  # (alpha, limit, offset)


def _clamped_swiglu_rows(
    a: torch.Tensor, b: torch.Tensor, w: torch.Tensor | None, clamp: Clamp, out: torch.Tensor
) -> None:
    """Write ``gated(min(a, l)) * (clamp(b, -l, l) + offset) (* w)`` into ``out``."""
    alpha, limit, offset = clamp
    y = _gated_(a.clamp(max=limit), alpha)
    b_c = _clamped_up(b, limit, offset)
    if w is None:
        torch.mul(y, b_c, out=out)
    else:
        torch.mul(y.mul_(b_c), w.unsqueeze(-1), out=out)


def _clamped_swiglu_grad_rows(
    g: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor | None,
    clamp: Clamp,
    grad_a: torch.Tensor,
    grad_b: torch.Tensor,
    need_w: bool,
) -> torch.Tensor | None:
    """Write the gradients wrt ``a`` and ``b`` of :func:`_clamped_swiglu_rows` (upstream ``g``)
    into ``grad_a``, ``grad_b``; return the one wrt ``w`` (``need_w``). The clamps pass the
    gradient where they do not bind, ends included (as torch's ``clamp``): each mask is one
    ``hardtanh_backward`` pass (which passes it strictly inside its bounds) with the bounds
    moved one float outwards. With alpha 1 the derivative of ``silu`` is torch's own, taken at
    ``a`` (equal to ``min(a, l)`` wherever the mask passes it)."""
    alpha, limit, offset = clamp
    w1 = None if w is None else w.unsqueeze(-1)
    a_c = a.clamp(max=limit)
    if alpha == 1.0:
        t = F.silu(a_c, inplace=True)  # (a_c is not needed again)
    else:
        s = torch.sigmoid(a_c * alpha)
        t = a_c * s
    t.mul_(g)  # g * gated(a_c): b's gradient before the weight and the clamp
    b_c = _clamped_up(b, limit, offset)
    grad_w = (t * b_c).sum(-1) if need_w else None
    if w1 is not None:
        t.mul_(w1)
    lo, hi = _outside(-limit, a.dtype, -1), _outside(limit, a.dtype, 1)
    torch.ops.aten.hardtanh_backward.grad_input(t, b, lo, hi, grad_input=grad_b)
    d_a = b_c.mul_(g) if w1 is None else b_c.mul_(g).mul_(w1)  # g * w * (b_c + offset)
    if alpha == 1.0:
        torch.ops.aten.silu_backward(d_a, a, grad_input=d_a)
    else:  # d(a sigmoid(alpha a))/da at a_c
        d_a.mul_(s.neg().add_(1).mul_(a_c).mul_(alpha).add_(1).mul_(s))
    torch.ops.aten.hardtanh_backward.grad_input(d_a, a, float("-inf"), hi, grad_input=grad_a)
    return grad_w


@functools.lru_cache(maxsize=64)
def _outside(bound: float, dtype: torch.dtype, direction: int) -> float:
    """The ``dtype`` number next to ``bound`` towards ``direction`` (+1 up, -1 down): ``x``
    strictly inside it is ``x`` within ``bound`` in that dtype."""
    b = torch.tensor(bound, dtype=dtype)
    return torch.nextafter(b, torch.tensor(direction * float("inf"), dtype=dtype)).item()


def _gated_(a: torch.Tensor, alpha: float) -> torch.Tensor:
    """``a * sigmoid(alpha * a)`` in place (torch's ``silu`` when alpha is 1)."""
    if alpha == 1.0:
        return F.silu(a, inplace=True)
    return a.mul_(torch.sigmoid(a * alpha))


def _clamped_up(b: torch.Tensor, limit: float, offset: float) -> torch.Tensor:
    """``clamp(b, -limit, limit) + offset`` (a new tensor)."""
    b_c = b.clamp(-limit, limit)
    return b_c if offset == 0 else b_c.add_(offset)


def clamped_swiglu_packed(
    h: torch.Tensor, w: torch.Tensor | None, alpha: float, limit: float, offset: float = 1.0
) -> torch.Tensor:
    """The clamped SwiGLU of ``h = [a | b]`` (last dim 2F): with ``a' = min(a, limit)`` and
    ``b' = b`` clamped to ``[-limit, limit]``, ``(b' + offset) * a' * sigmoid(alpha * a')``
    (last dim F, h's dtype; gpt-oss's with offset 1, DeepSeek-V4's ``silu(a') * b'`` with
    alpha 1 and offset 0), each row scaled by ``w`` (h.shape[:-1]; h's dtype or wider) when
    given; the clamps pass no gradient where they bind."""
    return _ClampedSwiGLUPacked.apply(h, w, alpha, limit, offset)


def clamped_swiglu(
    a: torch.Tensor, b: torch.Tensor, alpha: float, limit: float, offset: float = 1.0
) -> torch.Tensor:
    """:func:`clamped_swiglu_packed` of ``[a | b]`` unweighted, from the two halves as they are
    (the shared expert's and dense FFN's two projections: no packed copy)."""
    return _ClampedSwiGLU.apply(a, b, alpha, limit, offset)
