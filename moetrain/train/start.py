"""Where a run starts: resume a checkpoint of its run_dir, or load ``checkpoint.init_from``.

The rule, printed at start: a checkpoint to resume (``checkpoint.resume``: for ``auto`` the
newest checkpoint of the run's current timeline, for a path that checkpoint, or when it is the
one the current timeline started from, that timeline's newest: :mod:`moetrain.checkpoint.timeline`)
wins, so a restarted job continues where it stopped; otherwise ``checkpoint.init_from`` is
loaded (weights only: a fresh optimizer, schedule and data position); otherwise the weights
are random. Before any process group starts, a resume is checked against the checkpoint's
config (:mod:`moetrain.checkpoint.compat`) and a ``checkpoint.init_from`` source is opened and
checked against the config (:mod:`moetrain.init_from.source`) before anything is written to
run_dir. ``checkpoint.resume=none`` in a run_dir that already holds a complete checkpoint is
refused: the fresh run's saves would mix with the earlier run's, and ``checkpoint.keep_last``
would delete whichever have the lowest steps (the fresh run's own first ones).
"""

from __future__ import annotations

from pathlib import Path

from moetrain.checkpoint.catalog import latest_complete
from moetrain.checkpoint.checkpointer import Checkpointer, verify_on_every_rank
from moetrain.checkpoint.compat import UNRESHARDABLE_KEYS, mtp_chain_note, resume_conflicts
from moetrain.checkpoint.format import TrainerState, checkpoint_root, is_complete
from moetrain.checkpoint.timeline import plan_resume
from moetrain.config import Config, ConfigError
from moetrain.data.splits import prepared_tokenizer_sha256
from moetrain.init_from.source import InitSource, check_config_fits, open_init_source
from moetrain.init_from.upcycle import inexact_reasons
from moetrain.monitor.console import Printer, console
from moetrain.parallel.topology import Topology


def resume_candidate(cfg: Config) -> Path | None:
    """The checkpoint ``checkpoint.resume`` will load, None for a fresh start (read-only:
    nothing is removed; the path is checked when it is loaded)."""
    return plan_resume(cfg.checkpoint.resume, checkpoint_root(cfg.run_dir)).path


def will_resume(cfg: Config) -> bool:
    """Whether ``checkpoint.resume`` will load a checkpoint."""
    return resume_candidate(cfg) is not None


def check_start(cfg: Config, reset_optimizer: bool = False) -> None:
    """Refuse what cannot start (``ConfigError``; read-only, before any process group starts):
    ``checkpoint.resume=none`` where run_dir already holds a complete checkpoint, and a resume
    whose config contradicts the checkpoint's (every key with both values; the keys of
    :data:`~moetrain.checkpoint.compat.UNRESHARDABLE_KEYS` may change with
    ``reset_optimizer``)."""
    root = checkpoint_root(cfg.run_dir)
    if cfg.checkpoint.resume == "none" and (earlier := latest_complete(root)) is not None:
        raise ConfigError(
            f"checkpoint.resume=none: {root} already holds an earlier run's checkpoints (newest "
            f"{earlier.name}); a fresh run would save among them and checkpoint.keep_last would "
            "delete its own first ones. Use another run_dir, resume that run "
            "(checkpoint.resume=auto), or remove those checkpoints"
        )
    path = resume_candidate(cfg)
    if path is None or not is_complete(path):
        return  # (an incomplete checkpoint.resume=PATH is refused when it is looked for)
    state = TrainerState.read(path)
    tokenizer = prepared_tokenizer_sha256(cfg.data)
    conflicts = resume_conflicts(cfg, state.config, state.tokenizer_sha256, tokenizer)
    if reset_optimizer:
        conflicts = [c for c in conflicts if not c.startswith(UNRESHARDABLE_KEYS)]
    if conflicts:
        reset = [key for key in UNRESHARDABLE_KEYS if any(c.startswith(key) for c in conflicts)]
        hint = f" (for {', '.join(reset)} alone: --reset-optimizer)" if reset else ""
        raise ConfigError(
            f"checkpoint.resume: {path} cannot be continued with this config:\n  "
            + "\n  ".join(conflicts)
            + "\nset them as the checkpoint has them (what a resume may change is in "
            "docs/CHECKPOINTS.md), or start a new run from its weights with "
            f"checkpoint.init_from={path}{hint}"
        )


def open_start(cfg: Config, topo: Topology) -> InitSource | None:
    """The opened and checked ``checkpoint.init_from`` when the run will load it, else None;
    a moetrain checkpoint's files are CRC-checked once, each by one rank, every rank getting
    the same answer. Call before anything is written to run_dir: bad sources fail here."""
    if not cfg.checkpoint.init_from or will_resume(cfg):
        return None
    source = open_init_source(cfg.checkpoint.init_from)
    check_config_fits(cfg, source)
    if source.kind == "checkpoint":
        verify_on_every_rank(topo, source.path)
    return source


def choose_start(
    cfg: Config, checkpointer: Checkpointer, source: InitSource | None, printer: Printer = console
) -> Path | None:
    """The checkpoint to resume (None: start from ``source`` or random weights); says which
    on rank 0."""
    resume = checkpointer.find_resume()
    if not checkpointer.topo.is_main:
        return resume
    if resume is not None:
        state = TrainerState.read(resume)
        note = mtp_chain_note(state.config, state.mtp_chain)
        if note is not None:
            printer(f"warning: {resume}: {note}")
    init = cfg.checkpoint.init_from
    if resume is not None and init:
        printer(
            f"start: resuming {resume} (run_dir already has a checkpoint); "
            f"checkpoint.init_from={init} is not loaded"
        )
    elif source is not None:
        printer(
            f"start: weights from {source.path} ({source.describe()}); fresh optimizer, "
            "schedule and data position"
        )
        unread = source.config.model.mtp_depth - cfg.model.mtp_depth
        if unread > 0:
            printer(
                f"start: {unread} multi-token-prediction module(s) of the source not read "
                f"(model.mtp_depth={cfg.model.mtp_depth})"
            )
        if source.upcycle:
            reasons = inexact_reasons(cfg)
            exact = "exactly" if not reasons else "not exactly (" + "; ".join(reasons) + ")"
            printer(f"start: the upcycled model computes the dense model {exact} at step 0")
    return resume
