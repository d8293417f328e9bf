"""The short causal depthwise convolution of a linear-attention layer (Gated DeltaNet's and Kimi
Delta Attention's ``conv1d`` over q, k, v; kernel ``linear_conv_kernel_dim``, then SiLU).

Shape legend: B batch, S sequence, Ch channels, W kernel width, L = W - 1 the inputs a
position sees before itself.

    y[t, c] = act(bias[c] + sum_j weight[c, j] * x[t - L + j, c])

with x before the row taken from ``initial_state`` (the row's previous L inputs, the decode
cache) or zero. Packed documents: a document's first positions see zeros, never the previous
document, so a packed row computes what its documents compute one by one. This is done
exactly by one convolution over a buffer in which every document is preceded by L zeros (or
the initial state, for the row's first), without a loop over documents; the convolution runs
channels last with a written backward (:class:`Depthwise`: torch's depthwise ``conv1d``
backward is slow on CPU). The returned state is
the row's last L inputs, zero before its last document's start: what decoding that document
further needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moetrain.model.document_starts import document_starts

ACTIVATIONS = {"silu": F.silu, None: None}


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y (B, S, Ch) and, with ``output_final_state``, the state (B, L, Ch) for x (B, S, Ch),
    ``weight`` (Ch, W) (a depthwise ``nn.Conv1d``'s weight (Ch, 1, W) squeezed), ``bias`` (Ch,),
    ``activation`` "silu" or None, ``initial_state`` (B, L, Ch); ``doc_ids`` (B, S) or
    ``cu_seqlens`` (D + 1,) restart the window at every document (the module docstring)."""
    b, s, ch, w = _check(x, weight, bias, activation, initial_state)
    starts = document_starts(doc_ids, cu_seqlens, b, s)
    lead = w - 1
    state = x.new_zeros(b, lead, ch) if initial_state is None else initial_state.to(x.dtype)
    if starts is None:
        buf = torch.cat([state, x], 1)  # (B, L + S, Ch)
        y = Depthwise.apply(buf, weight, bias)
        last = buf[:, buf.shape[1] - lead :]
    else:
        y, last = _packed(x, state, weight, bias, starts)
    act = ACTIVATIONS[activation]
    y = y if act is None else act(y)
    return y, last.contiguous() if output_final_state else None


def _packed(x, state, weight, bias, starts):
    """The convolution of rows holding documents: every row, then every document start, is
    preceded by L slots (the row's state, or zeros) in one flat buffer (total, Ch)."""
    b, s, ch = x.shape
    lead = weight.shape[1] - 1
    per_row = s + lead + lead * starts.sum(1)  # each row's stretch of the buffer
    row_at = torch.cumsum(per_row, 0) - per_row
    shift = lead * (1 + torch.cumsum(starts.long(), 1))  # slots before (b, t) within its row
    pos = (row_at[:, None] + shift + torch.arange(s, device=x.device)).reshape(-1)
    buf = x.new_zeros(int(per_row.sum()), ch)
    buf = buf.index_copy(0, pos, x.reshape(b * s, ch))
    first = (row_at[:, None] + torch.arange(lead, device=x.device)).reshape(-1)
    buf = buf.index_copy(0, first, state.reshape(b * lead, ch))
    out = Depthwise.apply(buf[None], weight, bias)[0]
    y = out[pos - lead].reshape(b, s, ch)  # out[j]: the window ending at buf[j + L]
    tail = (row_at + per_row - lead)[:, None] + torch.arange(lead, device=x.device)
    return y, buf[tail.reshape(-1)].reshape(b, lead, ch)


class Depthwise(torch.autograd.Function):
    """``y[:, t] = bias + sum_j weight[:, j] * buf[:, t + j]``: the convolution over a buffer
    (B, L + S, Ch) holding the L inputs before each window, channels last (no transposes),
    summed in fp32 or wider and rounded once; it keeps the buffer, as ``F.conv1d`` would."""

    @staticmethod
    def forward(ctx, buf, weight, bias):
        wide = torch.promote_types(buf.dtype, torch.float32)
        w = weight.to(wide)
        s = buf.shape[1] - w.shape[1] + 1
        y = buf.new_zeros((*buf.shape[:1], s, buf.shape[2]), dtype=wide)
        if bias is not None:
            y += bias.to(wide)
        for j in range(w.shape[1]):
            y.addcmul_(buf[:, j : j + s], w[:, j])
        ctx.save_for_backward(buf, weight)
        ctx.has_bias = bias is not None
        return y.to(buf.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        buf, weight = ctx.saved_tensors
        wide = torch.promote_types(buf.dtype, torch.float32)
        dy, w = dy.to(wide), weight.to(wide)
        s = dy.shape[1]
        dbuf = buf.new_zeros(buf.shape, dtype=wide)
        dw = w.new_empty(w.shape)
        for j in range(w.shape[1]):
            dbuf[:, j : j + s].addcmul_(dy, w[:, j])
            dw[:, j] = (dy * buf[:, j : j + s]).sum((0, 1))
        dbias = dy.sum((0, 1)).to(weight.dtype) if ctx.has_bias else None
        return dbuf.to(buf.dtype), dw.to(weight.dtype), dbias


def _check(x, weight, bias, activation, initial_state) -> tuple[int, int, int, int]:
    """(B, S, Ch, W), refusing what does not fit by the tensor's name."""
    if x.dim() != 3:
        raise ValueError(f"x must be (B, S, Ch); got shape {tuple(x.shape)}")
    b, s, ch = x.shape
    if weight.dim() != 2 or weight.shape[0] != ch or weight.shape[1] < 1:
        raise ValueError(
            f"weight must be (Ch, W) = ({ch}, W >= 1) for x {tuple(x.shape)}; got "
            f"{tuple(weight.shape)}"
        )
    w = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (ch,):
        raise ValueError(f"bias must be (Ch,) = ({ch},); got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(map(str, ACTIVATIONS))}; got {activation!r}"
        )
    if initial_state is not None and tuple(initial_state.shape) != (b, w - 1, ch):
        raise ValueError(
            f"initial_state must be (B, W - 1, Ch) = {(b, w - 1, ch)}; got "
            f"{tuple(initial_state.shape)}"
        )
    return b, s, ch, w
