"""Rank functions for the checkpoint tests (importable by spawned processes).

They drive the real Trainer (DeepSpeed engine, expert parallelism) and the real Checkpointer on
the parity tests' tiny model and synthetic global batches. The data position saved with a
checkpoint comes from a small stand-in with the loader's state interface (the real loader's
resume is tested in tests/unit/test_data_loader.py and through the CLI in tests/e2e).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tests.distributed.parity_jobs import global_batches, parity_config, rank_slice


class StreamPosition:
    """The part of the loader's interface a checkpoint needs: a small state dict."""

    tokenizer_sha256 = None

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = state["consumed"]


def fixed_batch() -> torch.Tensor:
    return global_batches(99)[0]["input_ids"]


def _setup(world: int, ep: int, stage: int, run_dir: Path, **extra: Any):
    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    cfg = parity_config(world, ep, stage, run_dir=str(run_dir), **extra)
    topo = init_distributed(cfg)
    return cfg, topo, Trainer(cfg, topo), Checkpointer(cfg, topo)


def _train(trainer: Any, rank: int, world: int, steps: range, pos: StreamPosition) -> list[float]:
    losses = []
    for step in steps:
        rec = trainer.train_step([rank_slice(b, rank, world) for b in global_batches(step)])
        pos.consumed += 1
        losses.append(rec["loss"])
    return losses


@torch.no_grad()
def _logits(trainer: Any) -> torch.Tensor:
    trainer.engine.eval()
    out = trainer.engine(fixed_batch(), None, None)
    trainer.engine.train()
    return out.logits.float()


def save_job(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Train 2 steps at ep=2 and at ep=4 on 4 ranks, save both; return live weights and logits."""
    out: dict[str, Any] = {}
    for ep in (2, 4):
        d = Path(run_dir) / f"ep{ep}"
        cfg, topo, trainer, ckpt = _setup(world, ep, 2, d)
        pos = StreamPosition()
        _train(trainer, rank, world, range(2), pos)
        path = ckpt.save(trainer.run_state(pos))
        params = dict(trainer.model.named_parameters())
        experts = {n: p.detach().clone() for n, p in params.items() if ".experts." in n}
        out[f"ep{ep}"] = {
            "path": str(path),
            "experts": experts,
            "range": topo.local_experts(cfg.moe.num_experts),
            "logits": _logits(trainer),
            "dense": {n: p.detach().clone() for n, p in params.items() if ".experts." not in n},
        }
        del trainer
    return out


def reshard_job(rank: int, world: int, ckpt_path: str, run_dir: str) -> dict[str, Any]:
    """Load a checkpoint written by another layout, optimizer state included; train 2 steps."""
    ep = min(world, 2)
    cfg, topo, trainer, ckpt = _setup(world, ep, 2, Path(run_dir))
    pos = StreamPosition()
    state = ckpt.load(Path(ckpt_path), trainer.run_state(pos))
    logits = _logits(trainer)
    losses = _train(trainer, rank, world, range(state.step, state.step + 2), pos)
    return {
        "logits": logits,
        "step": state.step,
        "losses": losses,
        "consumed": pos.consumed,
        "lr": trainer.schedule.get_last_lr()[0],
    }


GROUP_TIMEOUT_MIN = 1.5  # not torch's default (30): shows that every group got the setting


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    """This rank's weights: whole, or at ZeRO-3 its partitions (what the optimizer updates; a
    parameter's own tensor is empty or a gathered copy there)."""
    params = trainer.model.named_parameters()
    return {n: getattr(p, "ds_tensor", p).detach().clone() for n, p in params}


def nan_job(rank: int, world: int, stage: int, run_dir: str, poison_steps: list[int]) -> dict:
    """Make rank 1's loss NaN at ``poison_steps``; record what every rank decided."""
    settings = {"train.max_nonfinite_in_a_row": 2, "parallel.timeout_minutes": GROUP_TIMEOUT_MIN}
    cfg, topo, trainer, _ = _setup(world, 2, stage, Path(run_dir), **settings)
    records: list[dict[str, Any]] = []
    unchanged: list[bool] = []
    error = None
    for step in range(5):
        handle = None
        if rank == 1 and step in poison_steps:
            handle = trainer.model.embed.register_forward_hook(lambda m, i, o: o * float("nan"))
        before = _weights(trainer)
        micro = [rank_slice(b, rank, world) for b in global_batches(step)]
        try:
            rec = trainer.train_step(micro)
        except FloatingPointError as e:
            error = str(e)
            break
        finally:
            if handle is not None:
                handle.remove()
        records.append({k: rec[k] for k in ("step", "loss", "skipped", "skipped_steps")})
        after = _weights(trainer)
        unchanged.append(all(torch.equal(before[n], after[n]) for n in before))
    return {
        "records": records,
        "unchanged": unchanged,
        "error": error,
        "finite": all(torch.isfinite(p).all() for p in _weights(trainer).values()),
    }


def nan_jobs(rank: int, world: int, run_dir: str, scenarios: list[tuple]) -> dict[str, Any]:
    """:func:`nan_job` for every ``(stage, poison_steps)`` in ``scenarios``, one after another in
    this process group (one start-up for all of them), each with a fresh Trainer and run_dir ->
    ``{"scenarios": [result, ...], "group_timeouts": {group: seconds}}`` (every process group
    but the world, which the test harness created, once moetrain and DeepSpeed built theirs)."""
    import torch.distributed as dist

    results = [
        nan_job(rank, world, stage, str(Path(run_dir) / f"scenario{i}"), poison_steps)
        for i, (stage, poison_steps) in enumerate(scenarios)
    ]
    timeouts = {
        name: pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for pg, name in dist.distributed_c10d._world.pg_names.items()
        if pg is not dist.group.WORLD
    }
    return {"scenarios": results, "group_timeouts": timeouts}


def timeout_job(rank: int, world: int, done_marker: str) -> str | None:
    """Rank 1 never reaches the barrier: rank 0 must fail quickly, naming what it waited for.

    Rank 1 stays alive (and away from the barrier) until rank 0 has its answer and leaves
    ``done_marker``, so rank 0 sees a timeout, not a peer that went away."""
    from moetrain.checkpoint.checkpointer import barrier
    from moetrain.parallel.topology import Topology

    topo = Topology(rank, world, rank, 1, "gloo", torch.device("cpu"))
    marker = Path(done_marker)
    if rank == 1:
        end = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < end:
            time.sleep(0.05)
        return None
    try:
        barrier(topo, "checkpoint step_00000007: write shards", timeout_minutes=0.03)
    except RuntimeError as e:
        return str(e)
    finally:
        marker.touch()
    return "no timeout"


# ----------------------------------------------------------------------------- resume, reshard

# Everything a resume has to restore exactly: router jitter draws from each rank's RNG, the
# aux-loss-free bias moves every step, capacity dropping depends on both.
RESUME_SETTINGS = {"moe.jitter": 0.1, "moe.bias_update_rate": 0.01, "moe.capacity_factor": 1.0}
# Layout parity needs the same function on every layout: no jitter (per-rank noise), dropless
# (capacity is per rank under EP); the bias still moves.
RESHARD_SETTINGS = {"moe.bias_update_rate": 0.01}


def _record(trainer: Any, rec: dict) -> dict[str, Any]:
    biases = [layer["expert_bias"] for _, layer in sorted((rec.get("moe_layers") or {}).items())]
    out = {"loss": rec["loss"], "lr": rec["lr"], "bias": biases}
    if "mtp_loss" in rec:
        out["mtp_loss"] = rec["mtp_loss"]
    return out


def _run_steps(trainer: Any, rank: int, world: int, steps: range, pos: StreamPosition) -> list:
    out = []
    for step in steps:
        rec = trainer.train_step([rank_slice(b, rank, world) for b in global_batches(step)])
        pos.consumed += 1
        out.append(_record(trainer, rec))
    return out


def resume_job(
    rank: int,
    world: int,
    layouts: list[tuple[int, int]],
    run_dir: str,
    steps: int,
    stop: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """For each ``(ep, stage)``: the uninterrupted run of ``steps`` steps, and the same run
    stopped after ``stop`` steps (checkpoint saved, a fresh Trainer built and resumed from it)
    -> per layout ``{"uninterrupted", "resumed", "checkpoint"}`` step records. ``extra``: more
    settings on top of :data:`RESUME_SETTINGS`."""
    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    out: dict[str, Any] = {}
    for ep, stage in layouts:
        d = Path(run_dir) / f"ep{ep}_zero{stage}"
        cfg = parity_config(world, ep, stage, run_dir=str(d), **RESUME_SETTINGS, **(extra or {}))
        topo = init_distributed(cfg)
        trainer = Trainer(cfg, topo)
        whole = _run_steps(trainer, rank, world, range(steps), StreamPosition())
        del trainer
        trainer, pos = Trainer(cfg, topo), StreamPosition()
        first = _run_steps(trainer, rank, world, range(stop), pos)
        path = Checkpointer(cfg, topo).save(trainer.run_state(pos))
        del trainer
        trainer, pos = Trainer(cfg, topo), StreamPosition()
        Checkpointer(cfg, topo).load(path, trainer.run_state(pos))
        assert trainer.progress.step == stop and pos.consumed == stop
        rest = _run_steps(trainer, rank, world, range(stop, steps), pos)
        out[f"ep{ep}_zero{stage}"] = {"uninterrupted": whole, "resumed": first + rest}
        del trainer
    return out


def reshard_source_job(
    rank: int,
    world: int,
    ep: int,
    stage: int,
    run_dir: str,
    steps: int,
    stop: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The reference on layout A: ``steps`` uninterrupted steps, with a checkpoint after
    ``stop`` of them -> ``{"records", "checkpoint"}``. ``extra``: more settings."""
    settings = {**RESHARD_SETTINGS, **(extra or {})}
    cfg, topo, trainer, ckpt = _setup(world, ep, stage, Path(run_dir), **settings)
    pos = StreamPosition()
    records = _run_steps(trainer, rank, world, range(stop), pos)
    path = ckpt.save(trainer.run_state(pos))
    records += _run_steps(trainer, rank, world, range(stop, steps), pos)
    return {"records": records, "checkpoint": str(path), **final_weights(trainer, topo, cfg)}


def final_weights(trainer: Any, topo: Any, cfg: Any) -> dict[str, Any]:
    """The weights at the end of a run (expert stacks: this rank's experts, and their range)."""
    return {
        "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "experts": topo.local_experts(cfg.moe.num_experts),
    }


def reshard_target_job(
    rank: int,
    world: int,
    targets: list[tuple[int, int, str, bool]],
    run_dir: str,
    steps: int,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """For each ``(ep, stage, checkpoint, reset_optimizer)``: resume on layout ``world`` x
    ``ep`` x ``stage`` and train to ``steps`` -> the step records after the resume.
    ``extra``: more settings."""
    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    settings = {**RESHARD_SETTINGS, **(extra or {})}
    out = []
    for i, (ep, stage, path, reset) in enumerate(targets):
        cfg = parity_config(world, ep, stage, run_dir=f"{run_dir}/t{i}", **settings)
        topo = init_distributed(cfg)
        trainer, pos = Trainer(cfg, topo), StreamPosition()
        state = Checkpointer(cfg, topo).load(
            Path(path), trainer.run_state(pos), reset_optimizer=reset
        )
        records = _run_steps(trainer, rank, world, range(state.step, steps), pos)
        done = {"records": records, "step": state.step, "consumed": pos.consumed}
        out.append(done | final_weights(trainer, topo, cfg))
        del trainer
    return out
