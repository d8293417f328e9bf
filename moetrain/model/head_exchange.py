"""The hook through which sequence parallelism reaches the token mixers, without the model knowing
how.

Shape legend: B batch, s this rank's slice of the sequence, S the whole sequence (``n * s``),
H heads, h = H / n heads per rank, X a head's dims.

Under sequence parallelism (``parallel.sp_size`` = n, Ulysses-style) each of n ranks holds
``s`` consecutive tokens of the same sequences. A :class:`HeadExchange` (the implementation,
an all-to-all over the ranks, is :mod:`moetrain.parallel.sequence_parallel`, attached from
outside by ``Transformer.set_head_exchange``, which hands it to every mixer's
``set_head_exchange``) turns per-head tensors (B, s, H, X) into (B, S, h, X), so each rank
mixes whole sequences for its h heads, and back. Which heads a mixer splits is its own (its
kind's ``sp_heads``: attention's query heads; a recurrent mixer's heads with every channel
that belongs to them, a short convolution's included); :func:`exchange_to_heads` and
:func:`exchange_to_sequence` are attention's use of it, :func:`gather_sequence` sparse
attention's (each rank's queries over every rank's keys, which all heads share). The model
only calls it; a model without one (``head_exchange`` None, the default) runs exactly as
before.

Rank ``rank`` holds positions ``[rank * s, (rank + 1) * s)`` (RoPE uses these global
positions) and heads ``[rank * h, (rank + 1) * h)``. Key/value heads: where their count ``G``
is not a multiple of n, each is repeated ``lcm(G, n) / G`` times first (:func:`kv_repeats`), so
every rank receives the key/value heads its query heads use.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class HeadExchange(Protocol):
    """Sequence slices <-> head slices over the ranks of one sequence-parallel group."""

    rank: int  # this rank's slice of every sequence
    size: int  # ranks (slices) per sequence

    def to_heads(self, x_BsHX: torch.Tensor) -> torch.Tensor:
        """(B, s, H, X) -> (B, n * s, H / n, X): every position, this rank's heads."""
        ...

    def to_sequence(self, x_BShX: torch.Tensor) -> torch.Tensor:
        """(B, S, h, X) -> (B, S / n, n * h, X): every head, this rank's positions."""
        ...


def kv_repeats(n_kv_heads: int, size: int) -> int:
    """How many times each key/value head is repeated so their count splits over ``size``
    ranks with every rank's query heads finding theirs: 1 when ``size`` divides it, else
    ``lcm(n_kv_heads, size) / n_kv_heads``."""
    return math.lcm(n_kv_heads, size) // n_kv_heads


def rank_channels(
    ex: HeadExchange, blocks: tuple[tuple[int, int], ...], device: torch.device
) -> torch.Tensor:
    """The channels of this rank's heads in a tensor whose channels are ``blocks`` of
    ``(first channel, width)`` each split over the ranks in head order (a short convolution's
    q, k, v blocks): this rank's ``1 / n`` of each block, in block order."""
    parts = []
    for first, width in blocks:
        per = width // ex.size
        parts.append(torch.arange(first + ex.rank * per, first + (ex.rank + 1) * per))
    return torch.cat(parts).to(device)


def exchange_to_heads(
    ex: HeadExchange, q_BHsX: torch.Tensor, k_BGsX: torch.Tensor, v_BGsX: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v laid out (B, heads, s, X) for this rank's positions -> (B, heads / n, S, X) for
    this rank's heads (keys and values repeated first where :func:`kv_repeats` says)."""
    rep = kv_repeats(k_BGsX.shape[1], ex.size)
    if rep > 1:
        k_BGsX = k_BGsX.repeat_interleave(rep, dim=1)
        v_BGsX = v_BGsX.repeat_interleave(rep, dim=1)

    def whole(x_BHsX: torch.Tensor) -> torch.Tensor:
        return ex.to_heads(x_BHsX.transpose(1, 2)).transpose(1, 2)

    return whole(q_BHsX), whole(k_BGsX), whole(v_BGsX)


def exchange_to_sequence(ex: HeadExchange, out_BhSX: torch.Tensor) -> torch.Tensor:
    """Attention's output (B, h, S, X) for this rank's heads -> (B, s, H, X) for its
    positions."""
    return ex.to_sequence(out_BhSX.transpose(1, 2))


def gather_sequence(ex: HeadExchange, x_BsX: torch.Tensor) -> torch.Tensor:
    """A tensor of one row per position that every head shares (latent attention's key latent,
    an indexer's key), this rank's positions (B, s, X) -> every rank's (B, S, X): the exchange
    of ``size`` copies as if each were one head. Its backward adds each position's gradients
    from every rank into the rank that holds the position."""
    b, s, x = x_BsX.shape
    return ex.to_heads(x_BsX[:, :, None].expand(b, s, ex.size, x))[:, :, 0]
