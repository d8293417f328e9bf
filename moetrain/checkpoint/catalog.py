"""The checkpoints of a run directory: which exist, which are complete, which to keep.

A checkpoint counts only once its commit marker exists. Nothing here talks to
torch.distributed: the caller orders the steps across ranks.
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
    return deleted, errors
