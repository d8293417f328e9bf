"""The checkpoints of a run directory: which exist, which are complete, which to keep.

A checkpoint counts only once its commit marker exists. The live timeline is the ``step_*``
directories directly under the checkpoint root; a rollback (resuming a checkpoint older than
the newest) moves the newer ones under :data:`ABANDONED_DIR`, where neither retention nor
``checkpoint.resume=auto`` looks. Nothing here talks to torch.distributed: the caller orders
the steps across ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from moetrain.checkpoint.format import (
    COMMIT_FILE,
    CheckpointError,
    checkpoint_root,
    is_complete,
    step_of,
)
from moetrain.fileio import fsync_dir

ABANDONED_DIR = "abandoned"


def checkpoint_dirs(root: Path) -> list[Path]:
    """All ``step_*`` directories under ``root``, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def complete_checkpoints(root: Path) -> list[Path]:
    return [p for p in checkpoint_dirs(root) if is_complete(p)]


def latest_complete(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (then its newest complete checkpoint)."""
    path = Path(path)
    root = checkpoint_root(path)
    if root.is_dir():
        latest = latest_complete(root)
        if latest is None:
            raise CheckpointError(f"{path}: run directory has no complete checkpoint")
        return latest
    return path


def remove_incomplete(root: Path) -> list[Path]:
    """Delete ``step_*`` directories without a commit marker (left by a crash during save)."""
    removed = []
    for p in checkpoint_dirs(root):
        if not is_complete(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def apply_retention(root: Path, keep_last: int) -> tuple[list[Path], list[str]]:
    """Keep the newest ``keep_last`` complete checkpoints; never delete the newest one.

    Returns (deleted, errors); a failed delete is reported, never raised, so training goes on.
    """
    keep_last = max(1, keep_last)
    done = complete_checkpoints(root)
    deleted, errors = [], []
    for p in done[:-keep_last]:
        try:
            # Un-commit first: a half-deleted directory must never look complete.
            (p / COMMIT_FILE).unlink()
            shutil.rmtree(p)
            deleted.append(p)
        except OSError as e:
            errors.append(f"{p}: {e}")
    if deleted:
        fsync_dir(root)
    return deleted, errors


def set_aside_newer(root: Path, step: int) -> Path | None:
    """Start a new timeline at ``step``: move every ``step_*`` directory newer than ``step``
    (complete or not) into ``<root>/abandoned/after_step_<step>[.<n>]``, keeping each intact.

    Returns the directory they went to, or None when nothing was newer. Both directories are
    fsynced, so after a power loss a moved checkpoint is in one place or the other, never lost.
    """
    root = Path(root)
    newer = [p for p in checkpoint_dirs(root) if (step_of(p) or 0) > step]
    if not newer:
        return None
    base = root / ABANDONED_DIR / f"after_step_{step}"
    dest, n = base, 0
    while dest.exists():
        n += 1
        dest = base.with_name(f"{base.name}.{n}")
    dest.mkdir(parents=True)
    fsync_dir(dest.parent)
    for p in newer:
        p.rename(dest / p.name)
    fsync_dir(dest)
    fsync_dir(root)
    return dest
