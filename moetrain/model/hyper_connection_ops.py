"""The hyper-connections' (:mod:`moetrain.model.hyper_connections`) per-token operations, each
written for few passes over the (tokens, N, D) streams and few saved tensors:

- :func:`normed_projection`: ``unit_rms(x) @ fn^T`` as ``(x @ fn^T) * rsqrt(mean(x^2) + eps)``
  (the RMS factor applied to the (tokens, W) product, never to a normalised (tokens, N * D)
  copy; a hand-written backward: one (tokens, N * D) product and one in-place pass);
- :func:`mixing_matrix`: the softmax and Sinkhorn-Knopp with a hand-written backward over the
  quotients it wrote into one buffer (autograd's graph has 4 nodes and 3 temporaries per
  division);
- :func:`collapse` and :func:`mix`: the streams' weighted sum and mix as batched products per
  token, their backwards written in the orientations torch's CPU batched matmul runs fast
  (per token (1, D) x (D, N) rather than (N, D) x (D, 1): 3-7x) and the outer product a
  broadcast multiply; no (tokens, N, D) temporaries.

Shape legend: T tokens, N streams, D d_model, K = N * D, W coefficients.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable


class _NormedProjection(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x_TK: torch.Tensor, fn_WK: torch.Tensor, eps: float
    ) -> torch.Tensor:
        k = x_TK.shape[-1]
        ms_T1 = torch.linalg.vector_norm(x_TK, dim=-1, keepdim=True).square_().div_(k)
        r_T1 = ms_T1.add_(eps).rsqrt_()
        out_TW = torch.mm(x_TK, fn_WK.t()).mul_(r_T1)
        ctx.save_for_backward(x_TK, fn_WK, r_T1, out_TW)
        return out_TW

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_TW: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # out = r * (x @ fn^T), r = (|x|^2 / K + eps)^-1/2, dr/dx = -r^3 x / K:
        # dx = (r g) @ fn - sum(g * out) r^2 / K * x; dfn = (r g)^T @ x
        x_TK, fn_WK, r_T1, out_TW = ctx.saved_tensors
        gr_TW = g_TW * r_T1
        dx = dfn = None
        if ctx.needs_input_grad[0]:
            alpha_T1 = (
                (g_TW * out_TW).sum(-1, keepdim=True).mul_(r_T1.square()).div_(-x_TK.shape[-1])
            )
            dx = torch.mm(gr_TW, fn_WK).addcmul_(x_TK, alpha_T1)
        if ctx.needs_input_grad[1]:
            dfn = torch.mm(gr_TW.t(), x_TK)
        return dx, dfn, None


def normed_projection(x_TK: torch.Tensor, fn_WK: torch.Tensor, eps: float) -> torch.Tensor:
    """``unit_rms(x, eps) @ fn^T`` (x, fn fp32; rows of x contiguous); equal to the normalised
    copy's product up to float rounding (the factor rounds once after the sum, not per entry)."""
    return _NormedProjection.apply(x_TK.contiguous(), fn_WK, eps)


class _MixingMatrix(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        # the matrices' entries outermost, tokens innermost (N, N, T): the softmax and every
        # sum and division run over long contiguous rows (the softmax 10x, Sinkhorn's steps
        # 2-3x faster at N = 4 than over (T, N, N))
        soft_NNT = torch.softmax(logits_TNN.permute(1, 2, 0).contiguous(), 1)
        x_NNT = soft_NNT + eps
        n, _, t = x_NNT.shape
        steps = 2 * iters - 1  # columns first, then rows and columns in turn
        quotients = x_NNT.new_empty(steps - 1, n, n, t)  # the last one is the output
        sums = x_NNT.new_empty(steps, n, t)
        for k in range(steps):
            axis = 0 if k % 2 == 0 else 1
            denominator = torch.sum(x_NNT, axis, keepdim=True, out=sums[k].unsqueeze(axis))
            denominator.add_(eps)
            x_NNT = torch.div(x_NNT, denominator, out=quotients[k] if k < steps - 1 else None)
        out_TNN = x_NNT.permute(2, 0, 1).contiguous()
        ctx.save_for_backward(soft_NNT, quotients, sums, out_TNN)
        return out_TNN

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_TNN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # a step y = x / (sum_axis x + eps) = x / d: dx = (g - sum_axis(g * y)) / d;
        # the softmax s over axis 1: dz = s * (g - sum_1(g * s))
        soft_NNT, quotients, sums, out_TNN = ctx.saved_tensors
        g_NNT = g_TNN.permute(1, 2, 0).contiguous()
        for k in reversed(range(sums.shape[0])):
            axis = 0 if k % 2 == 0 else 1
            y_NNT = quotients[k] if k < quotients.shape[0] else out_TNN.permute(1, 2, 0)
            g_NNT.sub_((g_NNT * y_NNT).sum(axis, keepdim=True)).div_(sums[k].unsqueeze(axis))
        g_NNT.sub_((g_NNT * soft_NNT).sum(1, keepdim=True)).mul_(soft_NNT)
        return g_NNT.permute(2, 0, 1).contiguous(), None, None


def mixing_matrix(logits_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Each token's (N, N) mixing matrix from its logits: ``softmax(logits) + eps`` over the
    last axis, made doubly stochastic by Sinkhorn-Knopp: columns normalised, then
    ``iters - 1`` times rows and columns, each divided by its sum + ``eps``. Returned
    contiguous (T, N, N): the mix's batched (N, N) products read it per token, and torch's CPU
    batched matmul copies every token's matrix on its own when they are strided (1.2-1.8x the
    mix's time, forward and backward). Saves the softmax, each quotient (the last: the output)
    and each denominator, as autograd would, in three buffers."""
    return _MixingMatrix.apply(logits_TNN, iters, eps)


class _Collapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TND, pre_TN)
        return torch.bmm(pre_TN.unsqueeze(1), x_TND).squeeze(1)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_TND, pre_TN = ctx.saved_tensors
        dx = dpre = None
        if ctx.needs_input_grad[0]:
            dx = pre_TN.unsqueeze(2) * g_TD.unsqueeze(1)
        if ctx.needs_input_grad[1]:
            dpre = torch.bmm(g_TD.unsqueeze(1), x_TND.transpose(1, 2)).squeeze(1)
        return dx, dpre


def collapse(streams_TND: torch.Tensor, pre_TN: torch.Tensor) -> torch.Tensor:
    """``sum_n pre_n * stream_n`` (T, D) (both in one dtype)."""
    return _Collapse.apply(streams_TND, pre_TN)


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x_TND: torch.Tensor,
        y_TD: torch.Tensor,
        post_TN: torch.Tensor,
        comb_TNN: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(x_TND, y_TD, post_TN, comb_TNN)
        new_TND = torch.bmm(comb_TNN.transpose(1, 2).contiguous(), x_TND)
        return new_TND.addcmul_(post_TN.unsqueeze(2), y_TD.unsqueeze(1))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_TND: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_TND, y_TD, post_TN, comb_TNN = ctx.saved_tensors
        g_TDN = g_TND.transpose(1, 2)
        grads: list[torch.Tensor | None] = [None] * 4
        if ctx.needs_input_grad[0]:
            grads[0] = torch.bmm(comb_TNN, g_TND)
        if ctx.needs_input_grad[1]:
            grads[1] = torch.bmm(post_TN.unsqueeze(1), g_TND).squeeze(1)
        if ctx.needs_input_grad[2]:
            grads[2] = torch.bmm(y_TD.unsqueeze(1), g_TDN).squeeze(1)
        if ctx.needs_input_grad[3]:
            grads[3] = torch.bmm(x_TND, g_TDN)
        return tuple(grads)


def mix(
    streams_TND: torch.Tensor, y_TD: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor
) -> torch.Tensor:
    """``new_k = sum_j comb[j, k] * stream_j + post_k * y`` (T, N, D) in the streams' dtype:
    the carried streams, then the branch's output added into the same buffer."""
    dtype = streams_TND.dtype
    return _Mix.apply(streams_TND, y_TD.contiguous(), post_TN.to(dtype), comb_TNN.to(dtype))
