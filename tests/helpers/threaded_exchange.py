"""Sequence parallelism's head exchange over n ranks inside one process: each rank a thread, the
all-to-all a swap through shared slots (its backward the reverse swap), the layout
:class:`moetrain.parallel.sequence_parallel.UlyssesExchange`'s own. A mixer's sequence-parallel
forward and backward run on every slice at once, to compare with one call on the whole rows
(values and gradients), without a process group."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from moetrain.parallel.sequence_parallel import UlyssesExchange


class _Hub:
    """The n ranks' slots: rank r's part j goes to rank j."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * size

    def swap(self, rank: int, send: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = send
        self.barrier.wait()
        recv = torch.stack([self.slots[i][rank] for i in range(self.size)])
        self.barrier.wait()  # every rank has read its parts before the slots are reused
        return recv


class _Swap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, hub, rank):  # noqa: ANN001, ANN205
        ctx.hub, ctx.rank = hub, rank
        return hub.swap(rank, send)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return ctx.hub.swap(ctx.rank, grad.contiguous()), None, None


class ThreadedExchange(UlyssesExchange):
    """Rank ``rank`` of ``hub``'s ranks: the Ulysses layout, the all-to-all a swap."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        super().__init__(None, rank, hub.size)
        self.hub = hub

    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return _Swap.apply(send, self.hub, self.rank)


def run_sliced(
    module: nn.Module,
    size: int,
    x_BSD: torch.Tensor,
    probe_BSD: torch.Tensor,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``module`` under sequence parallelism over ``size`` thread ranks: rank r a copy of it
    with a :class:`ThreadedExchange`, ``call(copy, slice)`` on positions ``[r s, (r + 1) s)``
    of ``x_BSD``, then backward of ``(out * probe).sum()`` over its slice (plus, where ``call``
    returns ``(out, loss)``, the rank's own scalar ``loss``). Returns the slices' outputs put
    together, the input's gradient and every parameter's gradient summed over the ranks (what
    the data-parallel reduction of the SP ranks adds up)."""
    hub = _Hub(size)
    s = x_BSD.shape[1] // size
    copies = [copy.deepcopy(module) for _ in range(size)]

    def rank_run(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = copies[rank]
        mixer.set_head_exchange(ThreadedExchange(hub, rank))
        part = x_BSD.detach()[:, rank * s : (rank + 1) * s].clone().requires_grad_()
        out = call(mixer, part)
        out, loss = out if isinstance(out, tuple) else (out, 0.0)
        ((out * probe_BSD[:, rank * s : (rank + 1) * s]).sum() + loss).backward()
        return out.detach(), part.grad

    with ThreadPoolExecutor(size) as pool:
        done = list(pool.map(rank_run, range(size)))
    grads = {}
    for name, _ in module.named_parameters():
        parts = [dict(c.named_parameters())[name].grad for c in copies]
        grads[name] = torch.stack([torch.zeros(()) if g is None else g for g in parts]).sum(0)
    return torch.cat([o for o, _ in done], 1), torch.cat([g for _, g in done], 1), grads
