"""Grouped SwiGLU experts with stacked weights.

Shape legend: N token copies grouped by expert, D d_model, F expert hidden, L local experts.

Parameters ``w1``, ``w3`` (L, D, F) and ``w2`` (L, F, D); expert ``l`` computes
``(silu(x @ w1[l]) * (x @ w3[l])) @ w2[l]`` on its contiguous slice of x_ND.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``F.grouped_mm``'s CPU backward fails on an expanded stride-0 gradient (e.g. straight
    after ``.sum()``), torch 2.13.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.contiguous()


def grouped_mm_supported(x_ND: torch.Tensor, w_LDF: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` can run here: any dtype on CPU (fp32 and bf16 tested, torch
    2.13); on CUDA bf16 on compute capability >= 9.0 with 16-byte aligned rows (not tested
    here: no GPU in CI). Elsewhere the per-expert loop is used."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x_ND.device.type == "cpu":
        return True
    if x_ND.device.type != "cuda" or x_ND.dtype != torch.bfloat16:
        return False
    aligned = w_LDF.shape[-1] % 8 == 0 and w_LDF.shape[-2] % 8 == 0
    return aligned and torch.cuda.get_device_capability(x_ND.device) >= (9, 0)


def _gmm(x_NI: torch.Tensor, w_LIO: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(F.grouped_mm(x_NI, w_LIO, offs=offs_L))


class GroupedExperts(nn.Module):
    """L SwiGLU experts; ``forward(x_ND, counts_L) -> y_ND``.

    ``grouped_mm=True`` uses ``torch.nn.functional.grouped_mm`` (one kernel per weight for all
    experts) where :func:`grouped_mm_supported`; otherwise, or with False, the per-expert loop
    (the reference) runs. Experts with zero tokens and
    N = 0 are fine: every weight still gets a (zero) gradient.
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, d_model))

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal(0, std) input projections, Normal(0, out_std) output projection."""
        nn.init.normal_(self.w1, 0.0, std)
        nn.init.normal_(self.w3, 0.0, std)
        nn.init.normal_(self.w2, 0.0, out_std)

    def forward(self, x_ND: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        if self.use_grouped_mm and x_ND.shape[0] > 0 and grouped_mm_supported(x_ND, self.w1):
            return self._forward_grouped(x_ND, counts_L)
        return self._forward_loop(x_ND, counts_L)

    def _forward_grouped(self, x_ND: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        offs_L = torch.cumsum(counts_L, 0, dtype=torch.int32)
        w1, w3, w2 = (w.to(x_ND.dtype) for w in (self.w1, self.w3, self.w2))
        h_NF = F.silu(_gmm(x_ND, w1, offs_L)) * _gmm(x_ND, w3, offs_L)
        return _gmm(h_NF, w2, offs_L)

    def _forward_loop(self, x_ND: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, x_nD in enumerate(torch.split(x_ND, counts_L.tolist())):
            h_nF = F.silu(x_nD @ self.w1[i].to(x_nD.dtype)) * (x_nD @ self.w3[i].to(x_nD.dtype))
            outs.append(h_nF @ self.w2[i].to(x_nD.dtype))
        return torch.cat(outs, 0)
