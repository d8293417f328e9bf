"""A run's timelines: which checkpoint a start continues, across rollbacks and restarts.

``checkpoint.resume=PATH`` starts a timeline at PATH. Once PATH is loaded, the run's
checkpoints newer than PATH's step are moved aside
(:func:`~moetrain.checkpoint.catalog.set_aside_newer`), then the event is appended to
``checkpoints/timelines.json`` (:data:`TIMELINES_FILE`): the timeline's number, the checkpoint
it starts from (resolved path, step, sha256 of its commit marker), where the newer checkpoints
went, and when. The timeline's own checkpoints are then the ``step_*`` directories under
``checkpoints/`` newer than its start; its newest checkpoint is the newest of them, or before
its first save the start itself (which may lie outside ``checkpoints/``: another run, or
``abandoned/``).

Which checkpoint a start resumes (:func:`plan_resume`):

- ``none``: none;
- ``auto``: the newest checkpoint of the current (last recorded) timeline; without a record,
  the newest complete checkpoint under ``checkpoints/``;
- a ``PATH`` that names the current timeline's start (the same resolved path and, while it
  exists, the same commit marker): the same command started again (``torchrun
  --max-restarts``, a requeue, a user running it again) continues that timeline, as ``auto``;
- any other ``PATH``: a new timeline at PATH.

Nothing here talks to torch.distributed: rank 0 decides and tells the others.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrain.checkpoint.catalog import complete_checkpoints, latest_complete
from moetrain.checkpoint.format import COMMIT_FILE, CheckpointError, is_complete, step_of
from moetrain.fileio import file_sha256, write_json_atomic

TIMELINES_FILE = "timelines.json"


@dataclass(frozen=True)
class ResumePlan:
    """What a start resumes: ``path`` (None: nothing), whether loading it starts a new timeline
    (``new``), and the current timeline it continues otherwise (``continues``, None without
    a record)."""

    path: Path | None
    new: bool = False
    continues: dict[str, Any] | None = None


def read_timelines(root: Path) -> list[dict[str, Any]]:
    """The recorded timelines of a checkpoint root, oldest first (empty without a record)."""
    path = Path(root) / TIMELINES_FILE
    if not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text())["timelines"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable record of the run's timelines ({e})") from None


def _commit_sha256(ckpt: Path) -> str:
    return file_sha256(Path(ckpt) / COMMIT_FILE)


def names_start(path: Path, timeline: dict[str, Any]) -> bool:
    """Whether ``path`` is the checkpoint ``timeline`` started from (same resolved path; the
    same commit marker while it still exists)."""
    if str(Path(path).resolve()) != timeline["start"]:
        return False
    return not is_complete(path) or _commit_sha256(path) == timeline["commit_sha256"]


def newest_of(root: Path, timeline: dict[str, Any]) -> Path:
    """The newest checkpoint of ``timeline``: its newest save under ``root``, else its start."""
    own = [p for p in complete_checkpoints(root) if (step_of(p) or 0) > timeline["step"]]
    if own:
        return own[-1]
    start = Path(timeline["start"])
    if not is_complete(start):
        raise CheckpointError(
            f"{Path(root) / TIMELINES_FILE}: timeline {timeline['number']} starts at {start}, "
            "which is no longer a complete checkpoint, and has saved none of its own; name the "
            "checkpoint to continue with checkpoint.resume=PATH"
        )
    return start


def plan_resume(mode: str, root: Path) -> ResumePlan:
    """The checkpoint ``checkpoint.resume=mode`` resumes under checkpoint root ``root`` (see the
    module docstring). Read-only; a new PATH is not checked here."""
    if mode == "none":
        return ResumePlan(None)
    timelines = read_timelines(root)
    current = timelines[-1] if timelines else None
    if mode == "auto" or (current is not None and names_start(Path(mode), current)):
        if current is None:
            return ResumePlan(latest_complete(root))
        return ResumePlan(newest_of(root, current), continues=current)
    return ResumePlan(Path(mode), new=True)


def record_timeline(root: Path, start: Path, step: int, moved_to: Path | None) -> dict[str, Any]:
    """Append a new timeline starting at ``start`` (step ``step``) to the record (atomically,
    fsynced); ``moved_to``: where the checkpoints newer than it went. Returns its entry."""
    root = Path(root)
    timelines = read_timelines(root)
    entry = {
        "number": len(timelines) + 1,
        "start": str(Path(start).resolve()),
        "step": step,
        "commit_sha256": _commit_sha256(start),
        "abandoned": str(moved_to) if moved_to is not None else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / TIMELINES_FILE, {"timelines": [*timelines, entry]}, sort_keys=False)
    return entry
