"""Checkpoint directory bookkeeping: atomic writes, commit markers, discovery, retention.

A checkpoint is ``<run_dir>/checkpoints/step_<N>/``. It counts only once ``COMMITTED.json``
exists inside it; that marker is written last, by global rank 0, after every rank has finished
writing (a barrier), through a temporary file + fsync + rename. DeepSpeed's own ``latest`` file
is never written or trusted. Nothing here talks to torch.distributed: the caller orders the
steps across ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

COMMIT_FILE = "COMMITTED.json"
_TAG_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run."""


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    m = _TAG_RE.match(path.name)
    return int(m.group(1)) if m else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` so that readers see either the old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def is_complete(ckpt: Path) -> bool:
    return (Path(ckpt) / COMMIT_FILE).is_file()


def read_commit(ckpt: Path) -> dict[str, Any]:
    """The commit marker's contents; a clear error when it is missing or unreadable."""
    marker = Path(ckpt) / COMMIT_FILE
    if not marker.is_file():
        raise CheckpointError(f"{ckpt}: not a complete checkpoint (no {COMMIT_FILE})")
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable commit marker: {e}") from None


def verify_manifest(ckpt: Path) -> None:
    """Every file listed in the commit marker exists with the size it had at commit."""
    for name, size in read_commit(ckpt).get("files", {}).items():
        f = Path(ckpt) / name
        if not f.is_file():
            raise CheckpointError(f"{f}: file listed in {COMMIT_FILE} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{f}: size {f.stat().st_size} != {size} recorded at commit (truncated or "
                "overwritten)"
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
    if (path / "checkpoints").is_dir():
        latest = latest_complete(path / "checkpoints")
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


def safe_torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` with errors that name the file.

    Refuses pickles that would run code (anything beyond tensors and plain containers), and
    reports truncated or corrupt files instead of a deep torch traceback.
    """
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it holds objects other than tensors and plain "
            f"containers (weights_only=True): {str(e).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint file: {e}") from None
