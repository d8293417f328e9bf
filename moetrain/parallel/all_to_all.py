"""Autograd all-to-all-v: each rank sends a variable number of rows to every peer.

Backward is the reverse exchange (gradients of received rows go back to their senders).
Built on ``torch.distributed.all_to_all_single`` with split sizes, which gloo, NCCL and others
support (gloo lacks the list form ``all_to_all``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def exchange_counts(send_counts: Tensor, group: Any) -> Tensor:
    """All-to-all of equal-sized count blocks (no gradient).

    ``send_counts`` has ``group_size * n`` int64 entries; block ``r`` goes to rank ``r``.
    Returns the received ``group_size * n`` entries, block ``s`` coming from rank ``s``.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return send_counts.clone()
    send = send_counts.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group
        )
        return grad_in, None, None, None


def all_to_all_v(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """Send ``x[rows of block r]`` to rank ``r`` (``in_splits[r]`` rows, in rank order); return
    the rows received, ``out_splits[s]`` from rank ``s``, in rank order. Differentiable."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAllV.apply(x, list(out_splits), list(in_splits), group)
