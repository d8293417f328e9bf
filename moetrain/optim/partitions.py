"""Where the matrices of a parameter group lie in the flat tensors the optimizer steps, and the
exchange that makes whole the matrices a ZeRO partition cuts.

At ZeRO stage 0 the optimizer steps the parameters themselves: each is one :class:`Piece`, whole.
At ZeRO-1/2 DeepSpeed hands it one flat fp32 partition per group, this rank's slice of the
group's parameters laid end to end: a parameter may start in one rank's partition and end in
the next one's. :func:`partition_pieces` reads, from each parameter's ``_hp_mapping`` (DeepSpeed's
map of its slice in this rank's partition), which slice of which parameter lies where.

A matrix (:func:`moetrain.optim.kinds.matrix_blocks`) that lies whole in a piece is updated by
the rank that holds it. One that a partition boundary cuts ("spanning", at most one per boundary)
is exchanged: the ranks of the group agree once on the list of such matrices (:class:`Exchange`),
and each step every rank writes the parts it holds into a zero buffer of them all, one
all-reduce (a sum in which every value has exactly one non-zero term, so exact) makes them
whole on every rank, and each rank keeps the part of the result it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moetrain.optim.kinds import Block, matrix_blocks


@dataclass(frozen=True)
class Piece:
    """``numel`` values of parameter ``name`` (of ``shape``), from ``param_start`` in the
    flattened parameter, at ``flat_start`` of the flat tensor the optimizer steps."""

    name: str
    shape: tuple[int, ...]
    param_start: int
    flat_start: int
    numel: int

    @property
    def param_stop(self) -> int:
        return self.param_start + self.numel

    def flat_of(self, param_index: int) -> int:
        """The flat tensor's index of the parameter's flat index ``param_index``."""
        return self.flat_start + param_index - self.param_start

    def whole(self) -> bool:
        return self.param_start == 0 and self.numel == torch.Size(self.shape).numel()


def whole_piece(name: str, param: torch.Tensor) -> Piece:
    """A parameter stepped as itself (ZeRO stage 0)."""
    return Piece(name, tuple(param.shape), 0, 0, param.numel())


def blocks_in(piece: Piece) -> tuple[list[Block], list[Block]]:
    """The matrix blocks of ``piece``'s parameter that lie whole in it, and those it holds
    only part of."""
    whole, cut = [], []
    for block in matrix_blocks(piece.name, piece.shape):
        if block.stop <= piece.param_start or block.start >= piece.param_stop:
            continue
        inside = block.start >= piece.param_start and block.stop <= piece.param_stop
        (whole if inside else cut).append(block)
    return whole, cut


@dataclass
class Exchange:
    """The cut matrices of one parameter group (the same list, in the same order, on every rank
    of ``group``): ``(name, block start) -> offset`` in the exchange buffer of ``size``."""

    group: Any  # the process group (None: one rank)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    size: int = 0

    def gather(self, pieces: list[tuple[Piece, Block]], u_flat: torch.Tensor) -> torch.Tensor:
        """The whole cut matrices: this rank's parts of ``u_flat`` in place, summed over the
        group (collective: every rank of the group calls it, in the same order)."""
        import torch.distributed as dist

        buffer = torch.zeros(self.size, dtype=u_flat.dtype, device=u_flat.device)
        for piece, block in pieces:
            lo, hi = max(piece.param_start, block.start), min(piece.param_stop, block.stop)
            at = self.offsets[(piece.name, block.start)] + lo - block.start
            buffer[at : at + hi - lo] = u_flat[piece.flat_of(lo) : piece.flat_of(hi)]
        if self.group is not None:
            dist.all_reduce(buffer, group=self.group)
        return buffer


def agree_on_cut_blocks(pieces: list[Piece], order: list[str], group: Any) -> Exchange:
    """The :class:`Exchange` of a group whose parameters are ``order`` (by name, the group's
    order) and of which this rank holds ``pieces``: every rank's cut blocks, agreed over
    ``group`` (one gather of names, once)."""
    import torch.distributed as dist

    mine = sorted({(p.name, b.start, b.numel) for p in pieces for b in blocks_in(p)[1]})
    if group is not None and dist.get_world_size(group) > 1:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        cut = {tuple(entry) for rank in everyone for entry in rank}
    else:
        cut = set(mine)
    position = {name: i for i, name in enumerate(order)}
    exchange = Exchange(group)
    for name, start, numel in sorted(cut, key=lambda c: (position[c[0]], c[1])):
        exchange.offsets[(name, start)] = exchange.size
        exchange.size += numel
    return exchange


def partition_pieces(
    lp_params: list[torch.Tensor], names: dict[int, str]
) -> tuple[list[Piece], list[str]]:
    """This rank's pieces of a ZeRO-1/2 group whose model parameters are ``lp_params`` (in the
    group's order; ``names`` by ``id``), and the group's parameter names in order."""
    pieces, order = [], []
    for p in lp_params:
        name = names[id(p)]
        order.append(name)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:  # no slice of it in this rank's partition
            continue
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        pieces.append(Piece(name, tuple(p.shape), int(lp.start), int(hp.start), int(lp.numel)))
    return pieces, order
