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


def _gmm(x_NI: torch.Tensor, w_LIO: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(F.grouped_mm(x_NI, w_LIO, offs=offs_L))


class GroupedExperts(nn.Module):
    """L SwiGLU experts; ``forward(x_ND, counts_L) -> y_ND``.

    ``grouped_mm=True`` uses ``torch.nn.functional.grouped_mm`` (one kernel per weight for all
    experts); False runs the per-expert loop (the reference). Experts with zero tokens and
    N = 0 are fine: every weight still gets a (zero) gradient.
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = grouped_mm and hasattr(F, "grouped_mm")
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, d_model))

    def forward(self, x_ND: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        if self.use_grouped_mm and x_ND.shape[0] > 0:
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
