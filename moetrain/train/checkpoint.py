"""Sharded checkpoints: save, atomic commit, resume, resharding.

Layout of ``<run_dir>/checkpoints/step_<N>/``:

- DeepSpeed's files: ``mp_rank_00_model_states.pt`` (dense weights and buffers, including the
  aux-loss-free biases), ``layer_<L>_expert_<G>_mp_rank_00_model_states.pt`` (one file per global
  expert per MoE layer, written once whatever the EP size) and
  ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (the ZeRO optimizer shards of each rank).
- ``rank_<r>.pt``: that rank's RNG states (tensors only; loaded with ``weights_only=True``).
- ``tokenizer.model``: a copy of the SentencePiece model the data was tokenized with.
- ``trainer_state.json``: step, consumed tokens, the data loader's position, the schedule, the
  layout it was written with, the resolved config (secrets removed), the tokenizer's sha256,
  moetrain's version, and the caller's extras (e.g. the wandb run id).
- ``COMMITTED.json``, written last by rank 0 once every rank has written and fsynced its files:
  it lists every file with its size, so a truncated file is found before anything is loaded.

DeepSpeed's ``latest`` file is not written (``save_latest=False``) and never trusted. DeepSpeed's
own loader unpickles its files: a checkpoint directory must be trusted like code. moetrain's own
files are JSON or are read with ``torch.load(weights_only=True)``.

Resharding: model weights always reshard (per-expert files). ZeRO optimizer shards are tied to
the data-parallel layout; resuming with another world size or EP size needs
``--reset-optimizer`` (weights, schedule and data position are restored; Adam moments restart).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import moetrain
from moetrain.config import Config
from moetrain.parallel.topology import Topology
from moetrain.secrets import redact
from moetrain.train.checkpoint_files import (
    COMMIT_FILE,
    CheckpointError,
    apply_retention,
    is_complete,
    latest_complete,
    remove_incomplete,
    safe_torch_load,
    step_of,
    tag_for_step,
    verify_manifest,
    write_json_atomic,
)

STATE_FILE = "trainer_state.json"
TOKENIZER_FILE = "tokenizer.model"
FORMAT_VERSION = 1


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "checkpoints"


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def barrier(topo: Topology, what: str, timeout_minutes: float) -> None:
    """A barrier that, on timeout, names what was being waited for (and, on gloo, which ranks
    did not arrive)."""
    if topo.world_size == 1:
        return
    try:
        if topo.backend == "gloo":
            timeout = timedelta(minutes=timeout_minutes)
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {topo.rank}: timed out or failed waiting for all ranks at '{what}' "
            f"(parallel.timeout_minutes): {e}"
        ) from e


def _same_on_every_rank(topo: Topology, value: Any, what: str) -> None:
    if topo.world_size == 1:
        return
    values: list[Any] = [None] * topo.world_size
    dist.all_gather_object(values, value)
    if any(v != values[0] for v in values):
        raise CheckpointError(f"{what} differs between ranks: {values}")


def _broadcast(topo: Topology, value: Any) -> Any:
    if topo.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    state["python"] = {"version": version, "state": torch.tensor(internal, dtype=torch.int64)}
    state["python_gauss"] = gauss
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"]), state["python_gauss"]))


class Checkpointer:
    """Saves and restores one run's checkpoints; every method is called on every rank."""

    def __init__(self, cfg: Config, topo: Topology) -> None:
        self.cfg, self.topo = cfg, topo
        self.root = checkpoint_root(cfg)

    def _barrier(self, what: str) -> None:
        barrier(self.topo, what, self.cfg.parallel.timeout_minutes)

    # ------------------------------------------------------------------ save
    def save(self, trainer: Any, loader: Any, extra: dict[str, Any] | None = None) -> Path:
        """Write a complete, committed checkpoint of ``trainer`` at its current step."""
        topo, step = self.topo, trainer.step
        tag = tag_for_step(step)
        path = self.root / tag
        _same_on_every_rank(topo, (str(self.root.resolve()), tag), "checkpoint path and tag")
        if topo.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():  # a leftover (partial, or an older run's) directory: start clean
                (path / COMMIT_FILE).unlink(missing_ok=True)
                shutil.rmtree(path)
        self._barrier(f"checkpoint {tag}: prepare directory")
        trainer.engine.save_checkpoint(str(self.root), tag=tag, save_latest=False)
        torch.save(_rng_state(), path / _rank_file(topo.rank))
        if topo.is_main:
            write_json_atomic(path / STATE_FILE, self._trainer_state(trainer, loader, extra))
            tokenizer = Path(self.cfg.data.output_dir) / TOKENIZER_FILE
            if tokenizer.is_file():  # the checkpoint converts without the data directory
                shutil.copyfile(tokenizer, path / TOKENIZER_FILE)
        self._barrier(f"checkpoint {tag}: write shards")
        files = sorted(p for p in path.iterdir() if p.is_file())
        for i, f in enumerate(files):
            if i % topo.world_size == topo.rank:
                _fsync_file(f)
        self._barrier(f"checkpoint {tag}: fsync shards")
        if topo.is_main:
            manifest = {f.name: f.stat().st_size for f in files}
            write_json_atomic(path / COMMIT_FILE, {"step": step, "files": manifest})
            deleted, errors = apply_retention(self.root, self.cfg.checkpoint.keep_last)
            for err in errors:
                print(f"moetrain: warning: could not delete old checkpoint: {err}", flush=True)
        self._barrier(f"checkpoint {tag}: commit")
        return path

    def _trainer_state(self, trainer: Any, loader: Any, extra: dict[str, Any] | None) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "moetrain_version": moetrain.__version__,
            "step": trainer.step,
            "tokens_seen": trainer.tokens_seen,
            "skipped_steps": trainer.skipped_steps,
            "loader": loader.state_dict(),
            "schedule": trainer.schedule.state_dict(),
            "layout": self.layout(),
            "tokenizer_sha256": getattr(loader, "tokenizer_sha256", None),
            "config": redact(self.cfg.to_dict()),
            "extra": redact(extra or {}),
        }

    def layout(self) -> dict[str, int]:
        return {
            "world_size": self.topo.world_size,
            "ep_size": self.topo.ep_size,
            "zero_stage": self.cfg.parallel.zero_stage,
        }

    # ------------------------------------------------------------------ resume
    def find_resume(self) -> Path | None:
        """The checkpoint to resume from per ``checkpoint.resume`` (same answer on every rank).

        ``auto``: the newest complete checkpoint under run_dir (incomplete ones are deleted);
        ``none``: start fresh; anything else: that checkpoint directory, which must be complete.
        """
        mode = self.cfg.checkpoint.resume
        found: str | None = None
        error: str | None = None
        if self.topo.is_main:
            if mode == "auto":
                for p in remove_incomplete(self.root):
                    print(f"moetrain: removed incomplete checkpoint {p}", flush=True)
                latest = latest_complete(self.root)
                found = str(latest) if latest else None
            elif mode != "none":
                p = Path(mode)
                if not is_complete(p):
                    error = (
                        f"checkpoint.resume={mode}: not a complete moetrain checkpoint "
                        f"(missing directory or {COMMIT_FILE})"
                    )
                found = str(p)
        found, error = _broadcast(self.topo, (found, error))
        if error:
            raise CheckpointError(error)
        return Path(found) if found else None

    def verify(self, path: Path) -> dict[str, Any]:
        """Check the commit manifest against the files on disk; return the trainer state."""
        verify_manifest(path)
        state = json.loads((path / STATE_FILE).read_text())
        if state.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: unsupported checkpoint format {state.get('format_version')}"
            )
        return state

    def load(
        self, path: Path, trainer: Any, loader: Any, reset_optimizer: bool = False
    ) -> dict[str, Any]:
        """Restore ``trainer`` and ``loader`` from ``path``; returns the saved trainer state."""
        state = self.verify(path)
        saved, now = state["layout"], self.layout()
        same_layout = saved == now
        if not same_layout and not reset_optimizer:
            raise CheckpointError(
                f"{path} was written with world_size={saved['world_size']}, "
                f"ep_size={saved['ep_size']}, zero_stage={saved['zero_stage']}; this run has "
                f"world_size={now['world_size']}, ep_size={now['ep_size']}, "
                f"zero_stage={now['zero_stage']}. ZeRO optimizer shards are tied to the layout: "
                "rerun with --reset-optimizer to load the weights, schedule and data position "
                "and restart the optimizer state"
            )
        if reset_optimizer and self.topo.is_main:
            print(
                "moetrain: warning: --reset-optimizer: loading weights only; Adam moments "
                "restart from zero",
                flush=True,
            )
        sha = state.get("tokenizer_sha256")
        if sha and getattr(loader, "tokenizer_sha256", sha) != sha:
            raise CheckpointError(
                f"{path} was trained with tokenizer sha256 {sha}, but the data in "
                f"{self.cfg.data.output_dir} uses {loader.tokenizer_sha256}"
            )
        load_optim = not reset_optimizer
        trainer.engine.load_checkpoint(
            str(path.parent),
            tag=path.name,
            load_optimizer_states=load_optim,
            load_lr_scheduler_states=False,
            load_module_only=not load_optim,
        )
        trainer.step = state["step"]
        trainer.tokens_seen = state["tokens_seen"]
        trainer.skipped_steps = state.get("skipped_steps", 0)
        trainer.schedule.load_state_dict(state["schedule"])
        loader.load_state_dict(state["loader"])
        if same_layout:
            rank_file = path / _rank_file(self.topo.rank)
            _set_rng_state(safe_torch_load(rank_file))
        if step_of(path) != state["step"]:
            raise CheckpointError(f"{path}: directory name and trainer state disagree on the step")
        return state
