"""Sequence parallelism (``parallel.sp_size``, Ulysses-style), applied to a model built on one
device.

Shape legend: B batch, s this rank's slice of the sequence, S the whole sequence, H heads,
h = H / n heads per rank, X a head's dims, n = ``sp_size``.

A sequence-parallel group is ``n`` consecutive ranks (:mod:`moetrain.parallel.topology`). Its
ranks get the same rows from the loader (its data-parallel rank is ``rank // n``) and each keeps
``S / n`` consecutive tokens of every row (:func:`shard_batch`: ``input_ids`` and ``labels``
sliced, ``doc_ids`` kept whole, because the document mask is that of the whole rows). Every
layer's token mixer exchanges heads for sequence (attention: after its q/k/v projections and
RoPE at the slice's global positions), mixes the whole sequences for its ``1 / n`` of the
heads (document mask included), and exchanges back before its output projection (each mixer
kind's own use of the exchange, :meth:`moetrain.model.mixers.TokenMixer.set_head_exchange`;
:class:`UlyssesExchange`:
an all-to-all of equal parts through :mod:`moetrain.parallel.all_to_all`'s autograd exchange,
as the expert dispatch uses, whose backward is the reverse exchange). Everything else (norms, FFNs, MoE routing and the expert all-to-all, the loss) is
per token and runs on the slice as it would on any rank's tokens.

Gradients: each rank's loss is the mean over its own tokens, every rank holds the same number of
tokens, and DeepSpeed averages gradients over every rank, so the SP ranks count as data-parallel
ranks and the result is the gradient of the global mean (expert weights as under plain EP;
checked by ``tests/distributed/test_sp_parity.py``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from moetrain.parallel.all_to_all import finish_all_to_all_v, start_all_to_all_v
from moetrain.parallel.topology import Topology


class UlyssesExchange:
    """:class:`moetrain.model.head_exchange.HeadExchange` over one sequence-parallel group: an
    autograd all-to-all of equal parts."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def _all_to_all(self, send: Tensor) -> Tensor:
        parts = [1] * self.size  # (n, ...): part j to and from rank j
        return finish_all_to_all_v(start_all_to_all_v(send, parts, parts, self.group))

    def to_heads(self, x_BsHX: Tensor) -> Tensor:
        b, s, heads, x = x_BsHX.shape
        n = self.size
        # part j (sent to rank j) = heads [j * h, (j + 1) * h) of this rank's positions
        send = x_BsHX.reshape(b, s, n, heads // n, x).permute(2, 0, 1, 3, 4).contiguous()
        recv = self._all_to_all(send)  # part i = rank i's positions, this rank's heads
        return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, heads // n, x)

    def to_sequence(self, x_BShX: Tensor) -> Tensor:
        b, seq, h, x = x_BShX.shape
        n = self.size
        # part j (sent to rank j) = rank j's positions of this rank's heads
        send = x_BShX.reshape(b, n, seq // n, h, x).permute(1, 0, 2, 3, 4).contiguous()
        recv = self._all_to_all(send)  # part i = rank i's heads, this rank's positions
        return recv.permute(1, 2, 0, 3, 4).reshape(b, seq // n, n * h, x)


def apply_sequence_parallel(model: nn.Module, topology: Topology) -> nn.Module:
    """Attach a :class:`UlyssesExchange` over this rank's sequence-parallel group to ``model``
    (a ``Transformer``; in place, returned); nothing when ``sp_size`` is 1."""
    if topology.sp_size > 1:
        model.set_head_exchange(
            UlyssesExchange(topology.sp_group, topology.sp_rank, topology.sp_size)
        )
    return model


def shard_batch(batch: dict[str, Tensor], topology: Topology) -> dict[str, Tensor]:
    """This rank's slice of a micro-batch of whole rows: ``input_ids`` and ``labels`` cut to
    positions ``[sp_rank * S / n, (sp_rank + 1) * S / n)``, ``doc_ids`` (and anything else)
    kept whole; the batch itself when ``sp_size`` is 1."""
    n = topology.sp_size
    if n == 1:
        return batch
    out = dict(batch)
    for key in ("input_ids", "labels"):
        t = batch[key]
        s = t.shape[1] // n
        out[key] = t[:, topology.sp_rank * s : (topology.sp_rank + 1) * s]
    return out
