"""Saving and resuming during training: every method runs on every rank.

A save writes DeepSpeed's files (``engine.save_checkpoint``, never its ``latest`` file), each
rank's RNG states, and on rank 0 the trainer state and the tokenizer; after a barrier every rank
fsyncs its share of the files, and after another rank 0 writes the commit manifest, last. A
resume takes the newest complete checkpoint (incomplete ones are removed). DeepSpeed's own loader
unpickles its files: a checkpoint directory must be trusted like code; moetrain's own files are
JSON or are read with ``torch.load(weights_only=True)``.

Resharding: model weights always reshard (per-expert files). ZeRO optimizer shards are tied to
the data-parallel layout; resuming with another world size or EP size needs
``--reset-optimizer`` (weights, schedule and data position are restored; Adam moments restart).
"""

from __future__ import annotations

import random
import shutil
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import moetrain
from moetrain.checkpoint.catalog import apply_retention, latest_complete, remove_incomplete
from moetrain.checkpoint.format import (
    COMMIT_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    CheckpointError,
    TrainerState,
    checkpoint_root,
    is_complete,
    manifest_of,
    rank_file,
    step_of,
    tag_for_step,
    verify_manifest,
)
from moetrain.checkpoint.io import fsync_file, safe_torch_load, write_json_atomic
from moetrain.monitor.console import Printer, console
from moetrain.secrets import redact

if TYPE_CHECKING:
    from moetrain.config import Config
    from moetrain.parallel.topology import Topology


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
    """Saves and restores one run's checkpoints; every method is called on every rank.

    ``trainer`` arguments need ``engine``, ``schedule``, ``step``, ``tokens_seen``,
    ``skipped_steps``, ``loss_scale_overflows``, ``checkpoint_weights()`` (a context for the
    save: the module holds the fp32 weights) and ``loss_scaler_state()`` /
    ``load_loss_scaler_state(state)``; ``loader`` arguments ``state_dict``/``load_state_dict``
    and ``tokenizer_sha256`` (and optionally ``tokenizer_files``: the tokenizer's files, copied
    into every checkpoint). ``printer`` gets the messages (rank 0 only).
    """

    def __init__(self, cfg: Config, topo: Topology, printer: Printer = console) -> None:
        self.cfg, self.topo, self.log = cfg, topo, printer
        self.root = checkpoint_root(cfg.run_dir)

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
        with trainer.checkpoint_weights():  # model files get the fp32 master weights
            trainer.engine.save_checkpoint(str(self.root), tag=tag, save_latest=False)
        torch.save(_rng_state(), path / rank_file(topo.rank))
        if topo.is_main:
            state = self._trainer_state(trainer, loader, extra)
            write_json_atomic(path / STATE_FILE, state.to_json())
            # the checkpoint converts without the data directory
            default = [Path(self.cfg.data.output_dir) / TOKENIZER_FILE]
            for f in getattr(loader, "tokenizer_files", None) or default:
                if f.is_file() and f.name in TOKENIZER_FILES:
                    shutil.copyfile(f, path / f.name)
        self._barrier(f"checkpoint {tag}: write shards")
        files = sorted(p for p in path.iterdir() if p.is_file())
        for i, f in enumerate(files):
            if i % topo.world_size == topo.rank:
                fsync_file(f)
        self._barrier(f"checkpoint {tag}: fsync shards")
        if topo.is_main:
            write_json_atomic(path / COMMIT_FILE, manifest_of(path, step))
            _, errors = apply_retention(self.root, self.cfg.checkpoint.keep_last)
            for err in errors:
                self.log(f"warning: could not delete old checkpoint: {err}")
        self._barrier(f"checkpoint {tag}: commit")
        return path

    def _trainer_state(
        self, trainer: Any, loader: Any, extra: dict[str, Any] | None
    ) -> TrainerState:
        return TrainerState(
            step=trainer.step,
            tokens_seen=trainer.tokens_seen,
            skipped_steps=trainer.skipped_steps,
            loss_scale_overflows=trainer.loss_scale_overflows,
            loss_scaler=trainer.loss_scaler_state(),
            loader=loader.state_dict(),
            schedule=trainer.schedule.state_dict(),
            layout=self.layout(),
            config=redact(self.cfg.to_dict()),
            tokenizer_sha256=getattr(loader, "tokenizer_sha256", None),
            extra=redact(extra or {}),
            init=getattr(trainer, "init_record", None),
            moetrain_version=moetrain.__version__,
        )

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
                    self.log(f"removed incomplete checkpoint {p}")
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

    def verify(self, path: Path) -> TrainerState:
        """Check the commit manifest against the files on disk; return the trainer state."""
        verify_manifest(path)
        state = TrainerState.read(path)
        if step_of(path) != state.step:
            raise CheckpointError(f"{path}: directory name and trainer state disagree on the step")
        return state

    def load(
        self, path: Path, trainer: Any, loader: Any, reset_optimizer: bool = False
    ) -> TrainerState:
        """Restore ``trainer`` and ``loader`` from ``path``; returns the saved trainer state."""
        state = self.verify(path)
        saved, now = state.layout, self.layout()
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
            self.log("warning: --reset-optimizer: loading weights only; Adam moments restart")
        sha = state.tokenizer_sha256
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
        trainer.step = state.step
        trainer.tokens_seen = state.tokens_seen
        trainer.skipped_steps = state.skipped_steps
        trainer.init_record = state.init
        trainer.loss_scale_overflows = state.loss_scale_overflows
        trainer.load_loss_scaler_state(state.loss_scaler)  # also after --reset-optimizer
        trainer.schedule.load_state_dict(state.schedule)
        loader.load_state_dict(state.loader)
        if same_layout:
            _set_rng_state(safe_torch_load(path / rank_file(self.topo.rank)))
        return state
