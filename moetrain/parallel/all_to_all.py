"""Autograd all-to-all-v: each rank sends a variable number of rows to every peer.

Backward is the reverse exchange (gradients of received rows go back to their senders).
Built on ``torch.distributed.all_to_all_single`` with split sizes, which gloo, NCCL and others
support (gloo lacks the list form ``all_to_all``).

An exchange can be left in flight while the caller computes something else:
``start_all_to_all_v`` launches it and ``finish_all_to_all_v`` waits for it. Autograd's engine
runs backward nodes latest-created first, so the backward of whatever was computed between the
two also runs while the reverse exchange is in flight (the finish node's backward launches it,
the start node's backward waits for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class TrafficMeter:
    """What one rank sends through the expert all-to-alls, as host integers (from split sizes
    that are already on the host: no sync): rows dispatched (to any rank, to other ranks, to
    other nodes), bytes of every exchange, forward and backward, to other ranks and to
    other nodes (shadow experts' weights and gradients included), and the shadow experts'
    replicas this rank received. ``me``: this rank's index in its group; ``nodes``: the node of
    each group rank.

    Rows and replicas are per dispatch: activation checkpointing runs a micro-batch's forward
    again in backward, so they are held as the last forward's (:meth:`add_rows` and
    :meth:`add_replicas` replace them) and counted once by :meth:`end_micro_batch`. Bytes are
    what goes over the wire: a recomputed forward's exchanges are sent again and count again.
    """

    FIELDS = (
        "rows",
        "rows_off_rank",
        "rows_off_node",
        "bytes_off_rank",
        "bytes_off_node",
        "replicas",
    )
    PER_DISPATCH = ("rows", "rows_off_rank", "rows_off_node", "replicas")

    def __init__(self, me: int, nodes: list[int]) -> None:
        self.me, self.nodes = me, list(nodes)
        self.totals = dict.fromkeys(self.FIELDS, 0)
        self.last_forward = dict.fromkeys(self.PER_DISPATCH, 0)

    def _split(self, per_peer: list[int]) -> tuple[int, int]:
        here = self.nodes[self.me]
        off_rank = sum(n for r, n in enumerate(per_peer) if r != self.me)
        off_node = sum(n for r, n in enumerate(per_peer) if self.nodes[r] != here)
        return off_rank, off_node

    def add_rows(self, per_peer: list[int]) -> None:
        """This forward's rows dispatched: ``per_peer[r]`` to group rank ``r``."""
        off_rank, off_node = self._split(per_peer)
        self.last_forward.update(rows=sum(per_peer), rows_off_rank=off_rank)
        self.last_forward["rows_off_node"] = off_node

    def add_bytes(self, per_peer: list[int], row_bytes: int) -> None:
        """An exchange sending ``per_peer[r]`` rows of ``row_bytes`` bytes to group rank ``r``."""
        off_rank, off_node = self._split(per_peer)
        self.totals["bytes_off_rank"] += off_rank * row_bytes
        self.totals["bytes_off_node"] += off_node * row_bytes

    def add_replicas(self, count: int) -> None:
        """This forward's shadow experts: ``count`` weights received from their owners."""
        self.last_forward["replicas"] = count

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward: count its forward's rows and replicas once."""
        for key, n in self.last_forward.items():
            self.totals[key] += n
        self.last_forward = dict.fromkeys(self.PER_DISPATCH, 0)

    def take(self) -> list[int]:
        """The totals in :attr:`FIELDS` order since the last call (a forward not yet ended by
        :meth:`end_micro_batch` included); resets them."""
        self.end_micro_batch()
        out = [self.totals[k] for k in self.FIELDS]
        self.totals = dict.fromkeys(self.FIELDS, 0)
        return out


def exchange_counts(send_counts: Tensor, group: Any, meter: TrafficMeter | None = None) -> Tensor:
    """All-to-all of equal-sized count blocks (no gradient).

    ``send_counts`` has ``group_size * n`` int64 entries; block ``r`` goes to rank ``r``.
    Returns the received ``group_size * n`` entries, block ``s`` coming from rank ``s``.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return send_counts.clone()
    send = send_counts.contiguous()
    recv = torch.empty_like(send)
    if meter is not None:
        meter.add_bytes([1] * size, send.numel() // size * send.element_size())
    dist.all_to_all_single(recv, send, group=group)
    return recv


class _Exchange:
    """One asynchronous exchange at a time (forward, then the reverse one in backward); its
    buffers stay referenced until it has finished."""

    def __init__(
        self, out_splits: list[int], in_splits: list[int], group: Any, meter: TrafficMeter | None
    ) -> None:
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.meter = meter
        self.work: Any = None
        self.buffers: tuple[Tensor, ...] = ()

    def launch(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        send = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        if self.meter is not None:
            self.meter.add_bytes(in_splits, math.prod(send.shape[1:]) * send.element_size())
        self.work = dist.all_to_all_single(
            out, send, out_splits, in_splits, group=self.group, async_op=True
        )
        self.buffers = (out, send)
        return out

    def wait(self) -> Tensor:
        self.work.wait()
        out = self.buffers[0]
        self.work, self.buffers = None, ()
        return out


class _StartAllToAllV(torch.autograd.Function):
    """Launches the exchange; returns the (not yet filled) receive buffer. Backward waits for
    the reverse exchange that ``_FinishAllToAllV``'s backward launched."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, exchange: _Exchange) -> Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return exchange.launch(x, exchange.out_splits, exchange.in_splits)

    @staticmethod
    def backward(ctx: Any, _unused: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return ctx.exchange.wait(), None


class _FinishAllToAllV(torch.autograd.Function):
    """Waits for the exchange; backward launches the reverse one (and passes its input through
    as the start node's placeholder gradient)."""

    @staticmethod
    def forward(ctx: Any, received: Tensor, exchange: _Exchange) -> Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return exchange.wait()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        ex = ctx.exchange
        ex.launch(grad_out, ex.in_splits, ex.out_splits)
        return grad_out, None


@dataclass
class InFlight:
    """An exchange started by :func:`start_all_to_all_v`; pass it to :func:`finish_all_to_all_v`."""

    received: Tensor
    exchange: _Exchange | None


def start_all_to_all_v(
    x: Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: Any,
    meter: TrafficMeter | None = None,
) -> InFlight:
    """Start sending ``x[rows of block r]`` to rank ``r`` (``in_splits[r]`` rows, in rank order);
    ``out_splits[s]`` rows will come from rank ``s``. Differentiable; every rank must start and
    finish its exchanges in the same order. ``meter`` counts the bytes of this exchange and of
    its reverse in backward."""
    if dist.get_world_size(group) == 1:
        return InFlight(x, None)
    exchange = _Exchange(list(out_splits), list(in_splits), group, meter)
    return InFlight(_StartAllToAllV.apply(x, exchange), exchange)


def finish_all_to_all_v(started: InFlight) -> Tensor:
    """Wait for a started exchange; returns the rows received, in rank order."""
    if started.exchange is None:
        return started.received
    return _FinishAllToAllV.apply(started.received, started.exchange)
