"""Rank function for tests/distributed/test_zero3_init_from.py (importable by spawned processes):
a run started from a Hugging Face directory at ZeRO-2 and at ZeRO-3, its first step, and what
each rank read of the source's files."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

SEQ = 16


def rank_batch(rank: int, vocab: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s micro-batch of the first step (2 rows)."""
    ids = torch.randint(0, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


@contextmanager
def metered_reads(log: dict[str, Any]):  # noqa: ANN201
    """Record every tensor read from a Hugging Face directory (``log["tensors"]``: name ->
    bytes, summed over reads) and the bytes of each unit a ZeRO-3 build read
    (``log["units"]``)."""
    from moetrain.convert.hf_files import HFWeights
    from moetrain.init_from.unit_reads import UnitReads

    log.update(tensors={}, units=[])
    load, rows, read = HFWeights.load, HFWeights.load_rows, UnitReads.read

    def count(name: str, t: torch.Tensor) -> torch.Tensor:
        log["tensors"][name] = log["tensors"].get(name, 0) + t.numel() * t.element_size()
        return t

    def metered_load(self, names):  # noqa: ANN001, ANN202
        return {n: count(n, t) for n, t in load(self, names).items()}

    def metered_rows(self, name, start, stop):  # noqa: ANN001, ANN202
        return count(name, rows(self, name, start, stop))

    def metered_read(self, *args):  # noqa: ANN001, ANN202
        out = read(self, *args)
        log["units"].append(sum(t.numel() * t.element_size() for t in out.values()))
        return out

    HFWeights.load, HFWeights.load_rows, UnitReads.read = metered_load, metered_rows, metered_read
    try:
        yield log
    finally:
        HFWeights.load, HFWeights.load_rows, UnitReads.read = load, rows, read


def init_from_job(rank: int, world: int, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Each run's overrides (``checkpoint.init_from`` among them) at ZeRO-2 and ZeRO-3 ->
    ``{"<run>/zero<stage>": {"ce": first step's cross-entropy, "tensors": ..., "units": ...}}``
    (:func:`metered_reads`)."""
    from moetrain.config import read_config_data
    from moetrain.init_from.source import check_config_fits, resolve_config_data
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    out: dict[str, Any] = {}
    for key, overrides in runs.items():
        for stage in (2, 3):
            data = read_config_data(None, [*overrides, f"parallel.zero_stage={stage}"])
            cfg, source = resolve_config_data(data)
            check_config_fits(cfg, source)
            topo = init_distributed(cfg)
            with metered_reads({}) as log:
                trainer = Trainer(cfg, topo, source)
            rec = trainer.train_step([rank_batch(rank, cfg.model.vocab_size)])
            out[f"{key}/zero{stage}"] = {"ce": rec["ce_loss"], **log}
            del trainer
    return out
