"""Saving and resuming during training: every method runs on every rank.

The checkpointer saves and restores a run's stateful objects (:class:`RunState`: the DeepSpeed
engine, the run's progress, the learning-rate schedule, the loss scaler, the data position) and
the process's RNG states; it knows nothing of the trainer that holds them.

A save writes DeepSpeed's files (``engine.save_checkpoint``, never its ``latest`` file), each
rank's RNG states, and on rank 0 the trainer state and the tokenizer. Every rank fsyncs and
measures (size, CRC-32) the files it wrote itself; the ranks exchange these lists, and rank 0
writes the manifest of all of them as the commit marker, last. A write error on any rank (a full
disk) stops every rank with the same error and removes the partial directory. A resume takes
the newest complete checkpoint (incomplete ones are removed) and checks every file against the
manifest before DeepSpeed unpickles anything. DeepSpeed's own loader unpickles its files: a
checkpoint directory must be trusted like code; moetrain's own files are JSON or are read with
``torch.load(weights_only=True)``.

Resharding: model weights always reshard (per-expert files; at ZeRO-3 each rank's partitions,
:mod:`moetrain.checkpoint.zero3_restore`), and the optimizer state is re-partitioned for another
world size, EP size or ZeRO stage (:mod:`moetrain.checkpoint.reshard`);
``--reset-optimizer`` loads weights, schedule and data position and restarts the optimizer state
(also the way from one ``optim.name`` to another).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

import moetrain
from moetrain.checkpoint.catalog import (
    apply_retention,
    latest_complete,
    remove_incomplete,
    set_aside_newer,
)
from moetrain.checkpoint.format import (
    COMMIT_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    CheckpointError,
    TrainerState,
    checkpoint_root,
    is_complete,
    manifest_from,
    manifest_names,
    rank_file,
    safe_torch_load,
    step_of,
    tag_for_step,
    verify_manifest,
)
from moetrain.checkpoint.rank_files import RankFiles
from moetrain.checkpoint.reshard import (
    SavedOptimizer,
    optimizer_param_names,
    restore_optimizer,
)
from moetrain.checkpoint.timeline import TIMELINES_FILE, plan_resume, record_timeline
from moetrain.checkpoint.zero3_restore import load_weights, restore_zero3_optimizer
from moetrain.faults import fault_point
from moetrain.fileio import atomic_file, fsync_dir, write_json_atomic
from moetrain.model.mtp import MTP_CHAIN
from moetrain.monitor.console import Printer, console
from moetrain.redact import redact

if TYPE_CHECKING:
    from moetrain.config import Config
    from moetrain.parallel.topology import Topology


class Stateful(Protocol):
    """An object whose state a checkpoint holds."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass(frozen=True)
class RunState:
    """The stateful objects of a run that a checkpoint saves and restores.

    ``engine``: the DeepSpeed engine (model weights, optimizer state); ``progress``: its state
    dict holds the :data:`~moetrain.checkpoint.format.PROGRESS_FIELDS` of ``trainer_state.json``;
    ``schedule``: the learning-rate schedule; ``loss_scaler``: the fp16 dynamic loss scaler
    (state None without one); ``data``: the training data position (small, JSON); ``fp32_weights``
    a context in which the engine's module holds the fp32 master weights (around DeepSpeed's
    save, so the model files hold them; collective). ``tokenizer_sha256`` is checked on resume
    and ``tokenizer_files`` are copied into every checkpoint (default: the data directory's
    ``tokenizer.model``).
    """

    engine: Any
    progress: Stateful
    schedule: Stateful
    loss_scaler: Stateful
    data: Stateful
    fp32_weights: Callable[[], AbstractContextManager[Any]]
    tokenizer_sha256: str | None = None
    tokenizer_files: tuple[Path, ...] = ()


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


def _gather(topo: Topology, value: Any) -> list[Any]:
    """``value`` of every rank, in rank order, on every rank."""
    if topo.world_size == 1:
        return [value]
    values: list[Any] = [None] * topo.world_size
    dist.all_gather_object(values, value)
    return values


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


def _without_sp(layout: dict[str, int]) -> dict[str, int]:
    """A recorded layout less its ``sp_size``: what DeepSpeed's files depend on."""
    return {k: v for k, v in layout.items() if k != "sp_size"}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"]), state["python_gauss"]))


def verify_on_every_rank(topo: Topology, path: Path) -> None:
    """Check every file of ``path``'s commit manifest (size and CRC-32), each file read by one
    rank; every rank raises the same CheckpointError if any file fails."""
    names = manifest_names(path)
    error = None
    try:
        verify_manifest(path, names[topo.rank :: topo.world_size])
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in _gather(topo, error) if e]
    if errors:
        raise CheckpointError(errors[0])


class Checkpointer:
    """Saves and restores one run's checkpoints (a :class:`RunState` each time); every method is
    called on every rank. ``printer`` gets the messages (rank 0 only)."""

    def __init__(self, cfg: Config, topo: Topology, printer: Printer = console) -> None:
        self.cfg, self.topo, self.log = cfg, topo, printer
        self.root = checkpoint_root(cfg.run_dir)
        self._new_timeline: Path | None = None  # (rank 0) a resume=PATH that starts one

    def _barrier(self, what: str) -> None:
        self.topo.phase(what)
        barrier(self.topo, what, self.cfg.parallel.timeout_minutes)

    # ------------------------------------------------------------------ save
    def save(self, run: RunState, extra: dict[str, Any] | None = None) -> Path:
        """Write a complete, committed checkpoint of ``run`` at its progress's step.

        Each rank writes, fsyncs and measures its own files (:class:`RankFiles`); the ranks
        then exchange their lists and errors in one gather. If any rank failed (a full disk),
        every rank raises the same :class:`CheckpointError` and rank 0 removes the partial
        directory: the previous checkpoint stays the newest complete one. Otherwise rank 0
        writes the manifest of every rank's files as the commit marker.
        """
        topo, progress = self.topo, run.progress.state_dict()
        step = progress["step"]
        tag = tag_for_step(step)
        path = self.root / tag
        topo.phase(f"checkpoint {tag}: save")
        _same_on_every_rank(topo, (str(self.root.resolve()), tag), "checkpoint path and tag")
        if topo.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():  # a leftover (partial, or an older run's) directory: start clean
                (path / COMMIT_FILE).unlink(missing_ok=True)
                shutil.rmtree(path)
        self._barrier(f"checkpoint {tag}: prepare directory")
        fault_point("save.before_shards", topo.rank, step)
        writes = RankFiles(path, topo.rank, step)
        # model files get the fp32 master weights
        with writes.through(run.engine), run.fp32_weights():
            run.engine.save_checkpoint(str(self.root), tag=tag, save_latest=False)
        writes.write(path / rank_file(topo.rank), lambda p: torch.save(_rng_state(), p))
        if topo.is_main:
            state = self._trainer_state(run, progress, extra).to_json()
            writes.write(path / STATE_FILE, lambda p: write_json_atomic(p, state))
            # the checkpoint converts without the data directory
            default = (Path(self.cfg.data.output_dir) / TOKENIZER_FILE,)
            for f in run.tokenizer_files or default:
                if f.is_file() and f.name in TOKENIZER_FILES:
                    writes.write(path / f.name, lambda p, f=f: shutil.copyfile(f, p))
        writes.finish()
        fault_point("save.after_shards", topo.rank, step)
        topo.phase(f"checkpoint {tag}: gather the ranks' file lists")
        written = _gather(topo, (writes.entries, writes.error))
        errors = [err for _, err in written if err]
        if errors:
            if topo.is_main:
                shutil.rmtree(path, ignore_errors=True)
            previous = latest_complete(self.root)
            raise CheckpointError(
                f"checkpoint {tag} could not be written ({'; '.join(errors)}); its partial "
                f"directory was removed, the newest complete checkpoint is "
                f"{previous.name if previous else 'none'}"
            )
        if topo.is_main:
            manifest = manifest_from(step, [entries for entries, _ in written])
            with atomic_file(path / COMMIT_FILE) as f:
                f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
                f.flush()
                fault_point("save.commit", topo.rank, step)
            fsync_dir(self.root)  # the new step directory's entry is durable before deletions
            _, errors = apply_retention(self.root, self.cfg.checkpoint.keep_last)
            for err in errors:
                self.log(f"warning: could not delete old checkpoint: {err}")
        self._barrier(f"checkpoint {tag}: commit")
        return path

    def _trainer_state(
        self, run: RunState, progress: dict[str, Any], extra: dict[str, Any] | None
    ) -> TrainerState:
        return TrainerState(
            **progress,
            loss_scaler=run.loss_scaler.state_dict(),
            loader=run.data.state_dict(),
            schedule=run.schedule.state_dict(),
            layout=self.layout(),
            config=redact(self.cfg.to_dict()),
            tokenizer_sha256=run.tokenizer_sha256,
            extra=redact(extra or {}),
            optimizer_params=optimizer_param_names(run.engine),
            moetrain_version=moetrain.__version__,
            mtp_chain=MTP_CHAIN,
        )

    def layout(self) -> dict[str, int]:
        """The layout a checkpoint records (``sp_size`` only when sequence parallel, so that
        checkpoints without it read as ``sp_size`` 1)."""
        layout = {
            "world_size": self.topo.world_size,
            "ep_size": self.topo.ep_size,
            "zero_stage": self.cfg.parallel.zero_stage,
        }
        if self.topo.sp_size > 1:
            layout["sp_size"] = self.topo.sp_size
        return layout

    # ------------------------------------------------------------------ resume
    def find_resume(self) -> Path | None:
        """The checkpoint to resume from per ``checkpoint.resume`` (same answer on every rank;
        :func:`~moetrain.checkpoint.timeline.plan_resume`).

        ``none``: start fresh; ``auto``, or the PATH the current timeline started from: the
        newest checkpoint of that timeline; any other PATH: that checkpoint directory, which
        must be complete, and loading it starts a new timeline (:meth:`load`). Incomplete
        checkpoints under run_dir are deleted first.
        """
        mode = self.cfg.checkpoint.resume
        found: str | None = None
        error: str | None = None
        if self.topo.is_main:
            try:
                if mode != "none":
                    for p in remove_incomplete(self.root):
                        self.log(f"removed incomplete checkpoint {p}")
                plan = plan_resume(mode, self.root)
                if plan.new and not is_complete(plan.path):
                    raise CheckpointError(
                        f"checkpoint.resume={mode}: not a complete moetrain checkpoint "
                        f"(missing directory or {COMMIT_FILE})"
                    )
                if plan.continues is not None and mode != "auto":
                    tl = plan.continues
                    self.log(
                        f"checkpoint.resume={mode} started timeline {tl['number']} (step "
                        f"{tl['step']}); continuing it from its newest checkpoint {plan.path}"
                    )
                found = str(plan.path) if plan.path else None
                self._new_timeline = plan.path if plan.new else None
            except CheckpointError as e:
                error = str(e)
        found, error = _broadcast(self.topo, (found, error))
        if error:
            raise CheckpointError(error)
        return Path(found) if found else None

    def verify(self, path: Path) -> TrainerState:
        """Check every file of the commit manifest (size and CRC-32; the ranks share the
        reading, every rank gets the same answer) before anything is unpickled; return the
        trainer state."""
        verify_on_every_rank(self.topo, path)
        state = TrainerState.read(path)
        if step_of(path) != state.step:
            raise CheckpointError(f"{path}: directory name and trainer state disagree on the step")
        return state

    def load(self, path: Path, run: RunState, reset_optimizer: bool = False) -> TrainerState:
        """Restore ``run`` from ``path``; returns the saved trainer state.

        On the layout that wrote it, DeepSpeed loads everything. On another world size, EP size
        or ZeRO stage the model weights come from the per-expert files and the optimizer state
        is re-partitioned (:mod:`moetrain.checkpoint.reshard`); ``reset_optimizer`` starts a
        fresh optimizer instead. RNG states are restored when the world size is the same.
        """
        topo = self.topo
        topo.phase(f"loading {path.name}")
        state = self.verify(path)
        saved, now = state.layout, self.layout()
        # ZeRO partitions over every rank whatever the sequence-parallel size (the SP ranks
        # count as data-parallel ranks for the gradient reduction), and the loader's position
        # counts whole sequences: a checkpoint resumes at any sp_size, and DeepSpeed loads
        # everything when world size, EP size and ZeRO stage are those that wrote it
        same_layout = _without_sp(saved) == _without_sp(now)
        if topo.is_main and saved.get("sp_size", 1) != now.get("sp_size", 1):
            self.log(
                f"{path.name} was written at parallel.sp_size={saved.get('sp_size', 1)}; "
                f"continuing at sp_size={now.get('sp_size', 1)}"
            )
        sha = state.tokenizer_sha256
        if sha and run.tokenizer_sha256 and run.tokenizer_sha256 != sha:
            raise CheckpointError(
                f"{path} was trained with tokenizer sha256 {sha}, but the data in "
                f"{self.cfg.data.output_dir} uses {run.tokenizer_sha256}"
            )
        # DeepSpeed's loader cannot read a stage-3 checkpoint's weights on another layout, nor
        # put another layout's into stage-3 partitions: moetrain's reader and writer do
        zero3 = not same_layout and 3 in (saved["zero_stage"], now["zero_stage"])
        saved_optimizer = None
        if not same_layout and not reset_optimizer:
            saved_optimizer = SavedOptimizer(path, state)  # read (and checked) before loading
        if topo.is_main:
            if reset_optimizer:
                self.log(
                    "warning: --reset-optimizer: loading weights only; the optimizer state restarts"
                )
            elif not same_layout:
                self.log(
                    f"resharding {path.name} from world_size={saved['world_size']}, "
                    f"ep_size={saved['ep_size']}, zero_stage={saved['zero_stage']} to "
                    f"world_size={now['world_size']}, ep_size={now['ep_size']}, "
                    f"zero_stage={now['zero_stage']} (optimizer state re-partitioned)"
                )
        experts = topo.local_experts(self.cfg.moe.num_experts)
        if zero3:
            load_weights(run.engine, path, self.cfg, experts)
        else:
            run.engine.load_checkpoint(
                str(path.parent),
                tag=path.name,
                load_optimizer_states=same_layout and not reset_optimizer,
                load_lr_scheduler_states=False,
                load_module_only=not same_layout or reset_optimizer,
            )
        if saved_optimizer is not None:
            restore = restore_zero3_optimizer if now["zero_stage"] == 3 else restore_optimizer
            restore(run.engine, saved_optimizer, experts)
        run.progress.load_state_dict(state.progress())
        run.loss_scaler.load_state_dict(state.loss_scaler)  # also after --reset-optimizer
        run.schedule.load_state_dict(state.schedule)
        run.data.load_state_dict(state.loader)
        if saved["world_size"] == now["world_size"]:
            _set_rng_state(safe_torch_load(path / rank_file(topo.rank)))
        if topo.is_main and self._new_timeline == path:
            self._start_timeline(path, state.step)
        return state

    def _start_timeline(self, path: Path, step: int) -> None:
        """After a successful load of a new ``checkpoint.resume=PATH``: the run's checkpoints
        newer than ``step`` belong to an abandoned timeline (a rollback); they are moved aside,
        never deleted, then the new timeline is recorded (:mod:`moetrain.checkpoint.timeline`),
        so that retention, ``resume=auto`` and the same command started again see only it."""
        moved_to = set_aside_newer(self.root, step)
        if moved_to is not None:
            names = ", ".join(sorted(p.name for p in moved_to.iterdir()))
            self.log(
                f"rollback to step {step}: the newer checkpoints ({names}) were moved to "
                f"{moved_to}; they are kept, and neither checkpoint.keep_last nor "
                "checkpoint.resume=auto considers them"
            )
        entry = record_timeline(self.root, path, step, moved_to)
        self._new_timeline = None
        self.log(
            f"timeline {entry['number']} starts at {path} (step {step}), recorded in "
            f"{self.root / TIMELINES_FILE}: a restart continues it, also with the same "
            f"checkpoint.resume"
        )
