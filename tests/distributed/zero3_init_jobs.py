"""Rank functions for tests/distributed/test_zero3_init_from.py (importable by spawned
processes): a run started from a Hugging Face directory (or a moetrain checkpoint) at ZeRO-2
and at ZeRO-3, its first step, and what each rank read of the source's files."""

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
    bytes, summed over reads), the bytes of each unit a ZeRO-3 build read (``log["units"]``)
    and the moetrain names of what it read (``log["names"]``, from either kind of source)."""
    from moetrain.convert.hf_files import HFWeights
    from moetrain.init_from.unit_reads import CheckpointUnitReads, UnitReads

    log.update(tensors={}, units=[], names=[])
    load, rows, read = HFWeights.load, HFWeights.load_rows, UnitReads.read
    checkpoint_read = CheckpointUnitReads.read

    def count(name: str, t: torch.Tensor) -> torch.Tensor:
        log["tensors"][name] = log["tensors"].get(name, 0) + t.numel() * t.element_size()
        return t

    def metered_load(self, names):  # noqa: ANN001, ANN202
        return {n: count(n, t) for n, t in load(self, names).items()}

    def metered_rows(self, name, start, stop):  # noqa: ANN001, ANN202
        return count(name, rows(self, name, start, stop))

    def metered(read):  # noqa: ANN001, ANN202
        def metered_read(self, *args):  # noqa: ANN001, ANN202
            out = read(self, *args)
            log["units"].append(sum(t.numel() * t.element_size() for t in out.values()))
            log["names"] += list(out)
            return out

        return metered_read

    HFWeights.load, HFWeights.load_rows = metered_load, metered_rows
    UnitReads.read, CheckpointUnitReads.read = metered(read), metered(checkpoint_read)
    try:
        yield log
    finally:
        HFWeights.load, HFWeights.load_rows, UnitReads.read = load, rows, read
        CheckpointUnitReads.read = checkpoint_read


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


class _Position:
    """The data position a checkpoint saves (these runs read no loader)."""

    def state_dict(self) -> dict[str, int]:
        return {"consumed": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def checkpoint_init_job(
    rank: int, world: int, runs: dict[str, list[str]], first: list[str], run: list[str]
) -> dict[str, Any]:
    """:func:`init_from_job` of ``runs``, then a moetrain checkpoint as a source: a run of
    ``first`` trains one step (on other batches) at ZeRO-2 and saves it; ``run`` (with
    ``checkpoint.init_from`` added) starts from it at ZeRO-2 and ZeRO-3 (``"checkpoint/zero<s>"``;
    ``"checkpoint/saved"``: the first run's step's cross-entropy)."""
    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.config import read_config_data
    from moetrain.init_from.source import resolve_config_data
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    out = init_from_job(rank, world, runs)
    cfg, source = resolve_config_data(read_config_data(None, [*first, "parallel.zero_stage=2"]))
    topo = init_distributed(cfg)
    trainer = Trainer(cfg, topo, source)
    rec = trainer.train_step([rank_batch(rank + world, cfg.model.vocab_size)])
    path = Checkpointer(cfg, topo).save(trainer.run_state(_Position()))
    del trainer
    out["checkpoint/saved"] = {"ce": rec["ce_loss"], "path": str(path)}
    return out | init_from_job(rank, world, {"checkpoint": [*run, f"checkpoint.init_from={path}"]})
