"""Rank functions for the Muon layout tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

from tests.distributed.parity_jobs import layouts_job


def without_exchange_job(rank: int, world: int, layouts: list[tuple]) -> dict[str, Any]:
    """:func:`~tests.distributed.parity_jobs.layouts_job` with the exchange of the matrices a
    partition cuts switched off (each rank orthogonalises only its own part of such a matrix,
    the rest zero): the control that shows the parity test sees a cut matrix handled wrongly."""
    from moetrain.optim.partitions import Exchange

    def own_parts_only(self, pieces, u_flat):  # noqa: ANN001, ANN202
        saved, self.group = self.group, None
        try:
            return gather(self, pieces, u_flat)
        finally:
            self.group = saved

    gather = Exchange.gather
    Exchange.gather = own_parts_only
    try:
        return layouts_job(rank, world, layouts)
    finally:
        Exchange.gather = gather


def bf16_job(rank: int, world: int, layouts: list[tuple[int, int]]) -> dict[str, Any]:
    """Muon in bf16 (``precision_jobs.bf16_run``) for every ``(ep, stage)`` of ``layouts``;
    the world-1 job also runs the fp32 reference (plain torch, one process)."""
    from tests.distributed.parity_jobs import reference_run
    from tests.distributed.parity_variants import VARIANTS
    from tests.distributed.precision_jobs import bf16_key, bf16_run

    out = {bf16_key(lay): bf16_run(rank, world, *lay, **VARIANTS["muon"]) for lay in layouts}
    if world == 1:
        out["fp32_reference"] = reference_run("muon")
    return out
