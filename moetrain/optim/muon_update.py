"""Muon's torch optimizer: Muon on the groups whose ``update`` is ``muon``, AdamW on the others,
on whatever ZeRO made of the groups.

Per Muon parameter (fp32 throughout, momentum and Newton-Schulz input included, whatever
``train.precision``): ``B <- mu B + g``; ``U = g + mu B`` (Nesterov) or ``B``; each matrix of U
orthogonalised on its own (:mod:`moetrain.optim.newton_schulz`; each expert's matrices on their own,
its gate and up projections apart, :func:`moetrain.optim.kinds.matrix_blocks`) and scaled by
``update_scale * sqrt(max(rows, cols))`` (Moonlight's rule: the update's RMS is about
``update_scale``, as AdamW's, so AdamW's learning rate and weight decay carry over); then
``W <- W (1 - lr wd) - lr U``. Clipping, accumulation and the data-parallel mean happened before
(on the gradient g), as for AdamW.

The momentum is elementwise, so it lives with the rank's partition like AdamW's moments (4 bytes
per parameter, partitioned); only the orthogonalisation needs whole matrices: a matrix that lies
whole in this rank's partition is orthogonalised here, one that a partition boundary cuts is made
whole by :class:`moetrain.optim.partitions.Exchange` (one all-reduce of the cut matrices per
group and step). Every rank thus gets the update one process computes from the same gradient:
a layout does not change it.

AdamW's groups go through torch's fused AdamW (the state shared with this optimizer), exactly
as ``optim.name: adamw`` steps them. With QK-clip (``optim.muon.qk_clip``) the trainer hands
:meth:`Muon.set_row_scales` the step's row multipliers of the query and key projections before
the step; they are applied to the updated weights of every group that holds them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moetrain.config import OptimConfig
from moetrain.optim.kinds import Block
from moetrain.optim.newton_schulz import DEFAULT_COEFFICIENTS, orthogonalize_into
from moetrain.optim.partitions import Exchange, Piece, blocks_in, whole_piece

MUON_KEYS = ("momentum_buffer",)


class Muon(torch.optim.Optimizer):
    """See the module docstring. ``names``: the model's parameter names by ``id``."""

    def __init__(
        self, groups: list[dict[str, Any]], names: dict[int, str], optim: OptimConfig
    ) -> None:
        m = optim.muon
        defaults = {
            "lr": optim.lr,
            "weight_decay": optim.weight_decay,
            "momentum": m.momentum,
            "nesterov": m.nesterov,
            "ns_steps": m.ns_steps,
            "update_scale": m.update_scale,
        }
        super().__init__(groups, defaults)
        self.names = names
        # id(flat partition) -> its pieces and the group's exchange (ZeRO-1/2, set by attach)
        self.pieces: dict[int, tuple[list[Piece], Exchange | None]] = {}
        self.row_scales: dict[str, torch.Tensor] = {}
        betas = (optim.beta1, optim.beta2)
        adamw = self._adamw_groups()
        self.adamw = (
            torch.optim.AdamW(adamw, lr=optim.lr, betas=betas, eps=optim.eps, fused=True)
            if adamw
            else None
        )
        self._link_adamw()

    def _adamw_groups(self) -> list[dict[str, Any]]:
        return [g for g in self.param_groups if g["update"] == "adamw"]

    def _link_adamw(self) -> None:
        if self.adamw is not None:
            self.adamw.param_groups = self._adamw_groups()
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link_adamw()  # (loading made new group dicts and a new state)

    def set_row_scales(self, scales: dict[str, torch.Tensor]) -> None:
        """Row multipliers (by parameter name: one per output row, a 1-D parameter's per
        element) for the weights of the next step (QK-clip); empty for none."""
        self.row_scales = scales

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102  (torch's interface)
        for group in self.param_groups:  # (ZeRO-1/2 hand over one group at a time)
            if group["update"] == "adamw":
                assert self.adamw is not None
                kept, self.adamw.param_groups = self.adamw.param_groups, [group]
                try:
                    self.adamw.step()
                finally:
                    self.adamw.param_groups = kept
            else:
                self._muon_step(group)
            if self.row_scales:
                for flat in group["params"]:
                    if flat.grad is not None:  # (a skipped step changes nothing)
                        self._scale_rows(flat)

    def _pieces(self, flat: torch.Tensor) -> tuple[list[Piece], Exchange | None]:
        found = self.pieces.get(id(flat))
        return found if found is not None else ([whole_piece(self.names[id(flat)], flat)], None)

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, decay, mu = group["lr"], group["weight_decay"], group["momentum"]
        for flat in group["params"]:
            if flat.grad is None:
                continue
            state = self.state[flat]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=flat.device)
                state["momentum_buffer"] = torch.zeros_like(flat, dtype=torch.float32)
            state["step"] += 1
            momentum, grad = state["momentum_buffer"], flat.grad
            momentum.mul_(mu).add_(grad)
            update = grad.add_(momentum, alpha=mu) if group["nesterov"] else grad.copy_(momentum)
            self._orthogonalize(flat, update.view(-1), group)
            flat.mul_(1 - lr * decay).add_(update.view_as(flat), alpha=-lr)

    def _orthogonalize(self, flat: torch.Tensor, u: torch.Tensor, group: dict[str, Any]) -> None:
        """Replace every matrix of ``u`` (``flat``'s update, flat) by its scaled orthogonalisation."""
        pieces, exchange = self._pieces(flat)
        cut: list[tuple[Piece, Block]] = []
        for piece in pieces:
            whole, partial = blocks_in(piece)
            if whole:  # (consecutive blocks of one parameter, all of one shape)
                run = u[piece.flat_of(whole[0].start) : piece.flat_of(whole[-1].stop)]
                first = whole[0]
                self._orthogonalize_blocks(
                    run.view(-1, first.rows, first.cols), first.splits, group
                )
            cut += [(piece, block) for block in partial]
        if exchange is None or exchange.size == 0:
            return
        buffer = exchange.gather(cut, u)
        for piece, block in cut:
            at = exchange.offsets[(piece.name, block.start)]
            done = buffer[at : at + block.numel]
            self._orthogonalize_blocks(done.view(1, block.rows, block.cols), block.splits, group)
            lo, hi = max(piece.param_start, block.start), min(piece.param_stop, block.stop)
            u[piece.flat_of(lo) : piece.flat_of(hi)] = done[lo - block.start : hi - block.start]

    def _orthogonalize_blocks(
        self, x_NRC: torch.Tensor, splits: int, group: dict[str, Any]
    ) -> None:
        """(N, rows, cols), in place: each of the N blocks' ``splits`` column chunks
        orthogonalised and scaled on its own."""
        n, rows, cols = x_NRC.shape
        width = cols // splits
        mats = x_NRC.view(n, rows, splits, width).transpose(1, 2)  # (N, splits, rows, width)
        scale = group["update_scale"] * math.sqrt(max(rows, width))
        orthogonalize_into(mats, mats, DEFAULT_COEFFICIENTS, group["ns_steps"], scale)

    def _scale_rows(self, flat: torch.Tensor) -> None:
        pieces, _ = self._pieces(flat)
        values = flat.view(-1)
        for piece in pieces:
            rows = self.row_scales.get(piece.name)
            if rows is None:
                continue
            per_row = math.prod(piece.shape) // rows.numel()
            index = torch.arange(piece.param_start, piece.param_stop, device=flat.device)
            span = values[piece.flat_start : piece.flat_start + piece.numel]
            span.mul_(rows.to(flat.device, flat.dtype)[index // per_row])
