"""Rank functions for tests/distributed/test_zero3_init_from.py (importable by spawned
processes): a run started from a Hugging Face directory (or a moetrain checkpoint) at ZeRO-2
and at ZeRO-3, its first step, and what each rank read of the source's files."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
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
    and the moetrain names of what it read (``log["names"]``, from either kind of source); of a
    checkpoint written at ZeRO-3, each tensor assembled from partitions (``log["partitions"]``:
    ``[name, saved EP rank]``, the EP rank None for a dense tensor)."""
    from moetrain.checkpoint.reshard import SavedOptimizer
    from moetrain.convert.hf_files import HFWeights
    from moetrain.init_from.unit_reads import CheckpointUnitReads, UnitReads

    log.update(tensors={}, units=[], names=[], partitions=[])
    load, rows, read = HFWeights.load, HFWeights.load_rows, UnitReads.read
    checkpoint_read, one = CheckpointUnitReads.read, SavedOptimizer._one

    def metered_one(self, name, ep_rank, key):  # noqa: ANN001, ANN202
        log["partitions"].append([name, ep_rank])
        return one(self, name, ep_rank, key)

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
    SavedOptimizer._one = metered_one
    try:
        yield log
    finally:
        HFWeights.load, HFWeights.load_rows, UnitReads.read = load, rows, read
        CheckpointUnitReads.read, SavedOptimizer._one = checkpoint_read, one


def init_from_job(
    rank: int, world: int, runs: dict[str, list[str]], stages: tuple[int, ...] = (2, 3)
) -> dict[str, Any]:
    """Each run's overrides (``checkpoint.init_from`` among them) at ZeRO ``stages`` ->
    ``{"<run>/zero<stage>": {"ce": first step's cross-entropy, "tensors": ..., "units": ...}}``
    (:func:`metered_reads`)."""
    from moetrain.config import read_config_data
    from moetrain.init_from.source import check_config_fits, resolve_config_data
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    out: dict[str, Any] = {}
    for key, overrides in runs.items():
        for stage in stages:
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


def _resaved_at_zero3(path: str, run: list[str]) -> str:
    """``path`` (a checkpoint written at ZeRO-2) resumed at ZeRO-3 (its weights and optimizer
    state re-partitioned, no step) and saved again by ``run`` (a run directory of its own): the
    same fp32 weights, in a checkpoint written at ZeRO-3."""
    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.config import read_config_data
    from moetrain.init_from.source import resolve_config_data
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    data = read_config_data(None, [*run, f"checkpoint.init_from={path}", "parallel.zero_stage=3"])
    cfg, _ = resolve_config_data(data)  # (the model's shape; the weights come from the resume)
    topo = init_distributed(cfg)
    trainer, checkpointer = Trainer(cfg, topo), Checkpointer(cfg, topo)
    checkpointer.load(Path(path), trainer.run_state(_Position()))
    return str(checkpointer.save(trainer.run_state(_Position())))


@contextmanager
def experts_of_the_other_rank():  # noqa: ANN201
    """A stage-3 checkpoint reader that hands each rank the other EP rank's experts (2 EP
    ranks): the bug the cross-entropy check must catch."""
    from moetrain.checkpoint.reshard import SavedOptimizer

    rows = SavedOptimizer.expert_rows

    def swapped(self, name, key, start, stop):  # noqa: ANN001, ANN202
        half = self.full_shape(name)[0] // 2
        return rows(
            self, name, key, (start + half) % (2 * half), (stop - 1 + half) % (2 * half) + 1
        )

    SavedOptimizer.expert_rows = swapped
    try:
        yield
    finally:
        SavedOptimizer.expert_rows = rows


def checkpoint_init_job(
    rank: int,
    world: int,
    runs: dict[str, list[str]],
    first: list[str],
    run: list[str],
    resave: list[str],
) -> dict[str, Any]:
    """:func:`init_from_job` of ``runs``, then moetrain checkpoints as sources: a run of
    ``first`` trains one step (on other batches) at ZeRO-2 and saves it; ``run`` (with
    ``checkpoint.init_from`` added) starts from it at ZeRO-2 and ZeRO-3 (``"checkpoint/zero<s>"``;
    ``"checkpoint/saved"``: the first run's step's cross-entropy). The same checkpoint resumed
    at ZeRO-3 and saved again by ``resave`` (:func:`_resaved_at_zero3`) starts ``run`` at ZeRO-2
    and ZeRO-3 too (``"checkpoint3/zero<s>"``), and once more at ZeRO-3 read with each rank
    given the other's experts (``"swapped/zero3"``, :func:`experts_of_the_other_rank`)."""
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
    out |= init_from_job(rank, world, {"checkpoint": [*run, f"checkpoint.init_from={path}"]})
    path3 = _resaved_at_zero3(str(path), resave)
    out |= init_from_job(rank, world, {"checkpoint3": [*run, f"checkpoint.init_from={path3}"]})
    with experts_of_the_other_rank():
        swapped = [*run, f"checkpoint.init_from={path3}"]
        out |= init_from_job(rank, world, {"swapped": swapped}, stages=(3,))
    return out
