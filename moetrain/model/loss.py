"""Cross-entropy of a linear LM head, computed over row chunks so the (N, V) logits never exist.

``chunked_cross_entropy(h, W, labels, chunk_rows, b)`` equals
``F.cross_entropy(F.linear(h, W, b).float(), labels, ignore_index=-100)`` (``b`` optional) (logits in h's dtype,
loss math in fp32), except that all-ignored labels (or N = 0) give 0 instead of NaN. With a
soft cap ``c`` the fp32 logits ``z`` become ``c * tanh(z / c)`` first (:func:`softcap`). The forward
pass computes, chunk by chunk, the logits, the loss and at once the gradients wrt h and W, so
only one (C, V) block is alive; backward just scales the stored gradients.

:class:`LMHead` is the LM head module: the logits, or this loss without them, both computed in
its own ``forward``, so that nothing reads the head's weights outside it (ZeRO-3 gathers a
module's parameters for its forward only).

Shape legend: N rows (tokens), C rows of one chunk, D hidden size, V vocabulary.
"""

from __future__ import annotations

import torch

from moetrain.model.cpu_matmul import Linear, add_product_, mm

IGNORE_INDEX = -100


def _chunk_loss(
    h_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_C: torch.Tensor,
    with_grad: bool,
    bias_V: torch.Tensor | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss of the chunk's labelled rows (fp32) and, with ``with_grad``, its gradient
    wrt the fp32 logits (softmax - one-hot; zero rows where the label is ignored; with a soft
    cap, times the cap's derivative ``1 - tanh^2``)."""
    valid_C1 = (labels_C != IGNORE_INDEX).unsqueeze(1)
    target_C1 = labels_C.unsqueeze(1).masked_fill(~valid_C1, 0)
    logits_CV = mm(h_CD, weight_VD.t())
    if bias_V is not None:  # (in h's dtype, as F.linear adds it)
        logits_CV = logits_CV + bias_V
    logits_CV = logits_CV.float()  # a fresh tensor: edited in place below
    tanh_CV = None
    if cap is not None:
        tanh_CV = logits_CV.div_(cap).tanh_()
        logits_CV = tanh_CV * cap
    max_C1 = logits_CV.amax(1, keepdim=True)
    shifted_target_C1 = logits_CV.gather(1, target_C1) - max_C1
    exp_CV = logits_CV.sub_(max_C1).exp_()
    sum_C1 = exp_CV.sum(1, keepdim=True)
    loss_C1 = sum_C1.log() - shifted_target_C1  # -log_softmax at the target, as F.cross_entropy
    loss_sum = torch.where(valid_C1, loss_C1, 0.0).sum()
    if not with_grad:
        return loss_sum, None
    grad_CV = exp_CV.mul_(valid_C1 / sum_C1)  # softmax on labelled rows, 0 on ignored ones
    grad_CV.scatter_add_(1, target_C1, -valid_C1.float())  # one index per row: deterministic
    if tanh_CV is not None:
        grad_CV.mul_(1 - tanh_CV.square_())
    return loss_sum, grad_CV


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h_ND @ weight_VD.T (+ bias_V)`` over labelled rows, in chunks of
    rows.

    Forward keeps the gradients unscaled (no 1/count, no grad_output) so that a large fp16 loss
    scale is applied in backward, before anything is rounded to fp16.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        h_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        labels_N: torch.Tensor,
        chunk_rows: int,
        bias_V: torch.Tensor | None = None,
        cap: float | None = None,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias_V is not None and ctx.needs_input_grad[4]
        n = h_ND.shape[0]
        grad_h_ND = (
            torch.empty_like(h_ND, memory_format=torch.contiguous_format) if need_h else None
        )
        # fp32 accumulator across chunks; matmul products stay in the input dtype
        grad_w_VD = torch.zeros_like(weight_VD, dtype=torch.float32) if need_w else None
        grad_b_V = torch.zeros_like(bias_V, dtype=torch.float32) if need_b else None
        total = h_ND.new_zeros((), dtype=torch.float32)
        for start in range(0, n, chunk_rows):
            rows = slice(start, min(start + chunk_rows, n))
            loss_sum, grad_CV = _chunk_loss(
                h_ND[rows], weight_VD, labels_N[rows], True, bias_V, cap
            )
            total += loss_sum
            if grad_b_V is not None:
                grad_b_V += grad_CV.sum(0)
            grad_CV = grad_CV.to(h_ND.dtype)
            if grad_h_ND is not None:
                grad_h_ND[rows] = mm(grad_CV, weight_VD)
            if grad_w_VD is not None:
                add_product_(grad_w_VD, grad_CV.t(), h_ND[rows])
            del grad_CV
        count = (labels_N != IGNORE_INDEX).sum().clamp_min(1)
        ctx.save_for_backward(grad_h_ND, grad_w_VD, grad_b_V, count)
        ctx.weight_dtype = weight_VD.dtype
        ctx.bias_dtype = None if bias_V is None else bias_V.dtype
        return total / count

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, torch.Tensor | None, None]:
        grad_h_ND, grad_w_VD, grad_b_V, count = ctx.saved_tensors
        scale = grad_out.float() / count
        grad_h = grad_h_ND * scale if grad_h_ND is not None else None  # keeps h's dtype
        grad_w = (grad_w_VD * scale).to(ctx.weight_dtype) if grad_w_VD is not None else None
        grad_b = (grad_b_V * scale).to(ctx.bias_dtype) if grad_b_V is not None else None
        return grad_h, grad_w, None, None, grad_b, None


def chunked_cross_entropy(
    h_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    chunk_rows: int,
    bias_V: torch.Tensor | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy (fp32 scalar) of the logits ``h_ND @ weight_VD.T (+ bias_V)`` (soft
    capped by ``cap`` where given) against ``labels_N`` (-100 ignored), ``chunk_rows`` rows at
    a time; 0 when every label is ignored.

    Gradients come back in the dtypes of ``h_ND`` and ``weight_VD`` (which must match).
    Without autograd (no_grad, or neither input requires grad) only the loss is computed.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"expected h (N, D) and weight (V, D); got {h_ND.shape}, {weight_VD.shape}"
        )
    if labels_N.shape != h_ND.shape[:1]:
        raise ValueError(f"expected labels ({h_ND.shape[0]},); got {tuple(labels_N.shape)}")
    if h_ND.dtype != weight_VD.dtype:
        raise ValueError(f"h and weight dtypes differ: {h_ND.dtype} vs {weight_VD.dtype}")
    needs = h_ND.requires_grad or weight_VD.requires_grad
    if torch.is_grad_enabled() and (needs or (bias_V is not None and bias_V.requires_grad)):
        return ChunkedLinearCrossEntropy.apply(h_ND, weight_VD, labels_N, chunk_rows, bias_V, cap)
    total = h_ND.new_zeros((), dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, h_ND.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            total += _chunk_loss(h_ND[rows], weight_VD, labels_N[rows], False, bias_V, cap)[0]
    return total / (labels_N != IGNORE_INDEX).sum().clamp_min(1)


class LMHead(Linear):
    """The LM head: ``nn.Linear``'s parameters and state-dict keys. ``head(h_ND)`` gives the
    logits; ``head(h_ND, labels_N, chunk_rows, scaling, cap)`` the mean cross-entropy of the
    logits divided by ``scaling`` (:func:`chunked_cross_entropy` of ``h / scaling`` and ``bias
    / scaling``: the same logits, up to rounding), soft-capped by ``cap`` where given, without
    building them."""

    def forward(
        self,
        h: torch.Tensor,
        labels_N: torch.Tensor | None = None,
        chunk_rows: int = 0,
        scaling: float = 1.0,
        cap: float | None = None,
    ) -> torch.Tensor:
        if labels_N is None:
            return super().forward(h)
        bias = self.bias
        if scaling != 1.0:
            h = h / scaling
            bias = None if bias is None else bias / scaling
        return chunked_cross_entropy(h, self.weight, labels_N, chunk_rows, bias, cap)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in the logits' dtype (Gemma's final-logit soft-capping,
    as transformers computes it); the logits themselves where ``cap`` is None."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
