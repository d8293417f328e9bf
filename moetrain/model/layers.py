"""Building blocks shared by attention and FFNs: RMSNorm, LayerNorm (``model.norm``), the SwiGLU
and squared-ReLU activations and MLPs (``model.ffn_activation``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig
from moetrain.model.clamped_swiglu import clamped_swiglu
from moetrain.model.cpu_matmul import Linear
from moetrain.model.row_blocks import row_blocks


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` (math in at least fp32, result in x's dtype),
    saving only ``x`` and the per-row rsqrt: autograd's composition also keeps an fp32 copy of x
    (under bf16/fp16) and the normalised x. With ``offset`` (a zero-centred norm, the weight an
    offset from it) ``(x * rsqrt(...) * (offset + weight))`` all in fp32, rounded once."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):  # noqa: ANN001, ANN205
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        if offset:
            return (x32 * rstd * (weight.to(rstd.dtype) + offset)).to(x.dtype)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight, rstd = ctx.saved_tensors
        xhat32 = x.to(rstd.dtype) * rstd
        grad_w = None
        if ctx.offset:
            g32 = grad.to(rstd.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = (g32 * xhat32).flatten(0, -2).sum(0).to(weight.dtype)
            grad_xhat32 = g32 * (weight.to(rstd.dtype) + ctx.offset)
        else:
            if ctx.needs_input_grad[1]:
                grad_w = (grad * xhat32.to(x.dtype)).to(rstd.dtype).flatten(0, -2).sum(0)
                grad_w = grad_w.to(weight.dtype)
            grad_xhat32 = (grad * weight).to(rstd.dtype)
        dot = (grad_xhat32 * xhat32).mean(-1, keepdim=True)
        grad_x = grad_xhat32.sub_(xhat32.mul_(dot)).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None, None


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back to the input dtype. ``offset``
    1.0: zero-centred (``model.zero_centered_norm``), the weight an offset from 1."""

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity scale: ones, or zeros when zero-centred."""
        self.weight.fill_(1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        centred = ", zero-centred" if self.offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{centred}"


class LayerNorm(nn.Module):
    """``weight * (x - mean(x)) / sqrt(var(x) + eps) + bias`` over the last dim (the biased
    variance, as ``nn.LayerNorm``), computed in at least fp32 and cast back to the input dtype;
    in fp32 exactly ``F.layer_norm``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        w, b = self.weight.to(wide), self.bias.to(wide)
        return F.layer_norm(x.to(wide), w.shape, w, b, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm | LayerNorm:
    """A block, final or MTP norm of ``dim`` as ``model.norm`` says (eps ``model.norm_eps``;
    zero-centred with ``model.zero_centered_norm``)."""
    if cfg.norm == "layernorm":
        return LayerNorm(dim, cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, norm_offset(cfg))


def norm_offset(cfg: ModelConfig) -> float:
    """The offset an RMSNorm's weight is held from: 1.0 with ``model.zero_centered_norm``."""
    return 1.0 if cfg.zero_centered_norm else 0.0


def _silu_mul_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, grad_a: torch.Tensor, grad_b: torch.Tensor
) -> None:
    """Write d/da and d/db of ``silu(a) * b`` (upstream ``grad``) into ``grad_a``, ``grad_b``."""
    torch.mul(grad, b, out=grad_b)  # scratch: grad * b
    torch.ops.aten.silu_backward(grad_b, a, grad_input=grad_a)
    torch.sigmoid(a, out=grad_b)
    grad_b.mul_(a).mul_(grad)  # grad * silu(a)


def _weighted_silu_mul_backward(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    grad_a: torch.Tensor,
    grad_b: torch.Tensor,
    need_w: bool,
) -> torch.Tensor | None:
    """Like :func:`_silu_mul_backward` for ``silu(a) * b * w[..., None]``; returns the gradient
    wrt ``w`` (``need_w``), computed from ``grad * silu(a)`` before it is scaled by w. No
    temporaries: ``grad_a`` holds the products of the row sums until it is written."""
    torch.sigmoid(a, out=grad_b)
    grad_b.mul_(a).mul_(grad)  # grad * silu(a)
    grad_w = torch.mul(grad_b, b, out=grad_a).sum(-1) if need_w else None
    w1 = w.unsqueeze(-1)
    grad_b.mul_(w1)
    torch.mul(grad, b, out=grad_a).mul_(w1)
    torch.ops.aten.silu_backward(grad_a, a, grad_input=grad_a)  # in place: same elements
    return grad_w


class _SiluMul(torch.autograd.Function):
    """``silu(a) * b`` saving only its inputs (autograd's composition also keeps ``silu(a)``)."""

    @staticmethod
    def forward(ctx, a, b):  # noqa: ANN001, ANN205
        ctx.save_for_backward(a, b)
        return F.silu(a).mul_(b)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        a, b = ctx.saved_tensors
        grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
        _silu_mul_backward(grad.contiguous(), a, b, grad_a, grad_b)
        return grad_a, grad_b


class _SiluMulPacked(torch.autograd.Function):
    """``silu(h[..., :F]) * h[..., F:]`` of a packed ``[gate | up]`` tensor, times a per-row
    weight ``w`` (h's shape without the last dim) when given; the gradient wrt h is written into
    one packed buffer (no per-half gradients to stitch back together). Saves h and w: the
    weight's gradient recomputes the unweighted product.

    A weight in a wider dtype than h (fp32 routing weights, bf16 activations) makes the weighted
    product's math run in the weight's dtype, rounded to h's dtype once, and the weight's
    gradient stays in its dtype. That math runs a block of rows at a time, so its wider
    temporaries stay a few MiB whatever the number of rows."""

    @staticmethod
    def forward(ctx, h, w):  # noqa: ANN001, ANN205
        ctx.save_for_backward(h, w)
        if w is not None and w.dtype != h.dtype:
            out = h.new_empty(*h.shape[:-1], h.shape[-1] // 2)
            for rows in row_blocks(h):
                a, b = h[rows].to(w.dtype).chunk(2, -1)
                out[rows] = F.silu(a).mul_(b).mul_(w[rows].unsqueeze(-1))
            return out
        a, b = h.chunk(2, dim=-1)
        out = F.silu(a).mul_(b)
        return out if w is None else out.mul_(w.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        h, w = ctx.saved_tensors
        grad, grad_w = grad.contiguous(), None
        grad_h = torch.empty_like(h)
        if w is None:
            _silu_mul_backward(grad, *h.chunk(2, -1), *grad_h.chunk(2, -1))
            return grad_h, None
        need_w = ctx.needs_input_grad[1]
        if w.dtype == h.dtype:
            a, b = h.chunk(2, -1)
            grad_w = _weighted_silu_mul_backward(grad, a, b, w, *grad_h.chunk(2, -1), need_w)
            return grad_h, grad_w
        grad_w = torch.empty_like(w) if need_w else None
        for rows in row_blocks(h):
            a, b = h[rows].to(w.dtype).chunk(2, -1)
            block = torch.empty_like(h[rows], dtype=w.dtype)
            g = grad[rows].to(w.dtype)
            gw = _weighted_silu_mul_backward(g, a, b, w[rows], *block.chunk(2, -1), need_w)
            grad_h[rows] = block
            if need_w:
                grad_w[rows] = gw
        return grad_h, grad_w


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(a) * b`` (same values and gradients, one tensor less saved)."""
    return _SiluMul.apply(a, b)


def silu_mul_packed(h: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation of ``h = [a | b]`` (last dim 2F) -> ``silu(a) * b`` (last dim F, h's
    dtype), each row scaled by ``w`` (h.shape[:-1]; h's dtype or wider) when given."""
    return _SiluMulPacked.apply(h, w)


def geglu_packed(h: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU of ``h = [a | b]`` (last dim 2F): ``gelu_tanh(a) * b`` (last dim F, h's dtype;
    transformers' ``gelu_pytorch_tanh``), each row scaled by ``w`` (h.shape[:-1]; h's dtype or
    wider, the math in the wider) when given."""
    wide = h.dtype if w is None else torch.promote_types(h.dtype, w.dtype)
    a, b = h.to(wide).chunk(2, dim=-1)
    y = F.gelu(a, approximate="tanh") * b
    return (y if w is None else y * w.unsqueeze(-1)).to(h.dtype)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the dense FFN and the shared expert; with ``activation``
    "geglu", ``w2(gelu_tanh(w1 x) * w3 x)``, with "clamped_swiglu"
    :func:`~moetrain.model.clamped_swiglu.clamped_swiglu` of ``w1 x`` and ``w3 x`` with ``clamp = (alpha, limit, offset)`` (``model.ffn_activation``)."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str = "swiglu",
        clamp: tuple[float, float, float] | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("swiglu", "geglu", "clamped_swiglu"):
            raise ValueError(f"unknown FFN activation {activation!r}")
        if (activation == "clamped_swiglu") != (clamp is not None):
            raise ValueError("the clamped SwiGLU needs its (alpha, limit, offset), only it")
        self.geglu = activation == "geglu"
        self.clamp = clamp
        self.w1 = Linear(d_model, hidden, bias=False)
        self.w3 = Linear(d_model, hidden, bias=False)
        self.w2 = Linear(hidden, d_model, bias=False)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden activation ``silu(w1 x) * w3 x`` (GeGLU's ``gelu_tanh``)."""
        if self.geglu:
            return F.gelu(self.w1(x), approximate="tanh") * self.w3(x)
        if self.clamp is not None:
            return clamped_swiglu(self.w1(x), self.w3(x), *self.clamp)
        return silu_mul(self.w1(x), self.w3(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.up(x))


class _Relu2Weighted(torch.autograd.Function):
    """``relu(h)^2 * w[..., None]`` saving only h and w (autograd's composition keeps the
    squared values and their widened copy too), its math in the wider of their dtypes a block
    of rows at a time, rounded to h's dtype once; the weight's gradient stays in its dtype."""

    @staticmethod
    def forward(ctx, h, w):  # noqa: ANN001, ANN205
        ctx.save_for_backward(h, w)
        out = torch.empty_like(h)
        for rows in row_blocks(h):
            r = torch.relu(h[rows].to(w.dtype))
            out[rows] = r.square_().mul_(w[rows].unsqueeze(-1))
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        h, w = ctx.saved_tensors
        grad_h = torch.empty_like(h)
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for rows in row_blocks(h):
            r = torch.relu(h[rows].to(w.dtype))
            g = grad[rows].to(w.dtype)
            if grad_w is not None:
                grad_w[rows] = (g * r * r).sum(-1)
            grad_h[rows] = r.mul_(g).mul_(2 * w[rows].unsqueeze(-1))
        return grad_h, grad_w


def relu2_packed(h: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """The squared ReLU ``relu(h)^2`` (not gated: h is the up projection alone, last dim F),
    each row scaled by ``w`` (h.shape[:-1]; h's dtype or wider) when given, computed in w's
    dtype and rounded to h's once."""
    if w is None:
        return torch.relu(h).square()
    return _Relu2Weighted.apply(h, w)


class ReluSquaredMLP(nn.Module):
    """``w2(relu(w1 x)^2)``: Nemotron-H's dense FFN and shared expert, not gated (``w1`` the up
    projection)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(d_model, hidden, bias=False)
        self.w2 = Linear(hidden, d_model, bias=False)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden activation ``relu(w1 x)^2``."""
        return relu2_packed(self.w1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.up(x))


MLP = SwiGLU | ReluSquaredMLP


def make_mlp(
    activation: str, d_model: int, hidden: int, clamp: tuple[float, float, float] | None = None
) -> MLP:
    """A dense FFN or shared expert of ``hidden`` with ``model.ffn_activation``'s
    ``activation`` (the clamped SwiGLU's ``clamp``: :meth:`MoEConfig.swiglu_clamp`)."""
    if activation == "relu2":
        return ReluSquaredMLP(d_model, hidden)
    return SwiGLU(d_model, hidden, activation, clamp if activation == "clamped_swiglu" else None)
