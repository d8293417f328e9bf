"""Rank functions for the ZeRO-3 tests (importable by spawned processes): the parity layouts'
training run (:mod:`tests.distributed.parity_jobs`) at ZeRO-2 and at ZeRO-3 in one group."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from tests.distributed.parity_jobs import _parallel_run, parity_config
from tests.distributed.parity_variants import VARIANTS

# what the stage-3 runs add to the parity configuration: the chunked loss in several chunks
# (the LM head's weight read in its own forward) and tied embeddings (one parameter, two modules)
STAGE3_EXTRA = {"model.loss_chunk_tokens": 8}
# what GLM-4.5's format holds: sigmoid scores with a moving selection bias, an ungated shared expert
GLM4_MOE = {
    "moe.score_func": "sigmoid",
    "moe.shared_expert_gate": False,
    "moe.shared_expert_hidden": 32,
}
CASES: dict[str, dict[str, Any]] = {
    "base": {},
    "mtp": VARIANTS["mtp"],
    "tied": {"model.tie_embeddings": True},
    # blocks recomputed in backward (their weights gathered a third time), the experts' SwiGLU
    "ckpt": {"parallel.activation_checkpointing": True, "moe.recompute_act": True},
    "bf16": {"train.precision": "bf16"},  # fp32 masters, accumulation and reduction
    # every weight partitioned (the default threshold keeps each of the tiny model's whole)
    "partitioned": {"parallel.zero3_persistence_elements": 0},
}


@contextmanager
def kept_whole(record: dict[str, int]):  # noqa: ANN201
    """Record, for each stage-3 Trainer built inside, how many of its weights DeepSpeed keeps
    whole on every rank (``ds_persist``, below ``parallel.zero3_persistence_elements``) and
    how many it has (``record["kept_whole"]``, ``record["weights"]``)."""
    import moetrain.train.trainer as trainer_module

    check = trainer_module.check_placement

    def counting(engine: Any, topology: Any) -> None:
        params = list(engine.module.parameters())
        record.update(kept_whole=sum(bool(p.ds_persist) for p in params), weights=len(params))
        check(engine, topology)

    trainer_module.check_placement = counting
    try:
        yield record
    finally:
        trainer_module.check_placement = check


def stages_job(
    rank: int, world: int, layouts: list[tuple[int, str]], steps: int
) -> dict[str, dict[str, Any]]:
    """Each ``(ep_size, case)`` of ``layouts`` trained ``steps`` steps at ZeRO-2 and ZeRO-3:
    ``{"ep2_mtp": {"zero2": run, "zero3": run}, ...}`` (runs as ``parity_jobs._parallel_run``'s,
    with ``ds_stage`` the stage DeepSpeed's engine ran, and at ZeRO-3 :func:`kept_whole`'s
    counts)."""
    out: dict[str, dict[str, Any]] = {}
    for ep, case in layouts:
        runs = {}
        for stage in (2, 3):
            cfg = parity_config(world, ep, stage, **STAGE3_EXTRA, **CASES[case])
            with kept_whole({}) as whole:
                runs[f"zero{stage}"] = {**_parallel_run(cfg, rank, world, steps), **whole}
        out[f"ep{ep}_{case}"] = runs
    return out


def export_source_job(rank: int, world: int, run_dir: str, ep: int) -> dict[str, Any]:
    """The same training at ZeRO-2 and at ZeRO-3 (``ep``, 2 steps, a checkpoint after each;
    :data:`GLM4_MOE`) -> per stage ``{"checkpoints": [step 1, step 2], "logits": the live model's on a fixed
    batch after step 2}``."""
    from pathlib import Path

    from tests.distributed.checkpoint_jobs import StreamPosition, _logits, _setup, _train

    out: dict[str, Any] = {}
    for stage in (2, 3):
        d = Path(run_dir) / f"zero{stage}"
        _, _, trainer, ckpt = _setup(world, ep, stage, d, **GLM4_MOE)
        pos, paths = StreamPosition(), []
        for step in range(2):
            _train(trainer, rank, world, range(step, step + 1), pos)
            paths.append(str(ckpt.save(trainer.run_state(pos))))
        out[f"zero{stage}"] = {"checkpoints": paths, "logits": _logits(trainer)}
        del trainer
    return out


def reshard_job(
    rank: int, world: int, run_dir: str, steps: int, stop: int, targets: list[tuple]
) -> dict[str, Any]:
    """Layout A runs of ``steps`` steps with a checkpoint after ``stop`` (``"zero2"``: ZeRO-2,
    ``"zero3"``: ZeRO-3, both at ep=2), then each target ``(source, ep, stage, reset)`` resumed
    from that checkpoint on this world and trained to ``steps`` -> ``{"source": {name: A's
    records}, "targets": [records after each resume]}``. Every weight partitioned (none kept
    whole at stage 3: the tiny model's weights are all below
    ``parallel.zero3_persistence_elements``' default)."""
    from tests.distributed.checkpoint_jobs import reshard_source_job, reshard_target_job

    extra = {"parallel.zero3_persistence_elements": 0}
    sources = {
        f"zero{stage}": reshard_source_job(
            rank, world, 2, stage, f"{run_dir}/a{stage}", steps, stop, extra
        )
        for stage in (2, 3)
    }
    resumes = [
        (ep, stage, sources[source]["checkpoint"], reset) for source, ep, stage, reset in targets
    ]
    done = reshard_target_job(rank, world, resumes, f"{run_dir}/b", steps, extra)
    return {
        "source": {k: v["records"] for k, v in sources.items()},
        "targets": [{"records": d["records"], "step": d["step"]} for d in done],
    }


def sp_stages_job(rank: int, world: int, layouts: list[tuple]) -> dict[str, dict[str, Any]]:
    """Each ``(sp, ep, variant or None)`` of ``layouts`` trained at ZeRO-2 and ZeRO-3 on the
    sequence-parallel parity tests' packed documents (:mod:`tests.distributed.sp_parity_jobs`)
    -> ``{"sp2_ep1_mla": {"zero2": run, "zero3": run}, ...}``."""
    from tests.distributed.sp_parity_jobs import _parallel_run as sp_run
    from tests.distributed.sp_parity_jobs import sp_config

    out: dict[str, dict[str, Any]] = {}
    for sp, ep, variant in layouts:
        runs = {
            f"zero{s}": sp_run(sp_config(world, sp, ep, s, variant), rank, world) for s in (2, 3)
        }
        out[f"sp{sp}_ep{ep}_{variant or 'base'}"] = runs
    return out
