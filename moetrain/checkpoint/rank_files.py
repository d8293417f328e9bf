"""The files one rank writes during a save: each one recorded, fsynced and measured by the rank
that wrote it, and the first write error kept instead of raised.

Keeping the error lets the failing rank go on through DeepSpeed's own barriers, so that every
rank reaches the point where they agree on the outcome (a full disk on one rank then stops every
rank with the same clear error instead of leaving the others waiting for the timeout).
DeepSpeed's files are recorded by wrapping the engine's checkpoint engine, which every DeepSpeed
file of a save goes through (``checkpoint_engine.save(state_dict, path)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moetrain.checkpoint.format import FileEntry, file_entry
from moetrain.faults import fault_point
from moetrain.fileio import fsync_dir, fsync_file


class RankFiles:
    """The files this rank wrote into one checkpoint directory (``entries``: name -> size and
    CRC-32) and the first error (``error``, None if every write succeeded)."""

    def __init__(self, directory: Path, rank: int, step: int) -> None:
        self.directory, self.rank, self.step = Path(directory), rank, step
        self.entries: dict[str, FileEntry] = {}
        self.error: str | None = None

    def write(self, path: Path, writer: Callable[[Path], None]) -> None:
        """Run ``writer(path)``, then fsync and record the file; an OSError is kept. After an
        error nothing more is written: the checkpoint is lost anyway."""
        if self.error is not None:
            return
        path = Path(path)
        try:
            fault_point("save.write", self.rank, self.step)
            writer(path)
            fsync_file(path)
            self.entries[path.name] = file_entry(path)
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
            self.error = f"rank {self.rank}: writing {path.name}: {e}"

    def finish(self) -> None:
        """Make the directory entries of this rank's files durable too."""
        if self.error is None and self.entries:
            try:
                fsync_dir(self.directory)
            except OSError as e:
                self.error = f"rank {self.rank}: {e}"

    @contextmanager
    def through(self, engine: Any) -> Iterator[None]:
        """While active, every file ``engine`` (DeepSpeed) saves is written by :meth:`write`, and
        a failure to copy DeepSpeed's recovery scripts (rank 0) is kept like a write error."""
        inner = engine.checkpoint_engine
        engine.checkpoint_engine = _Recorder(inner, self)
        copy_scripts = engine._copy_recovery_script  # DeepSpeed 0.19's, outside the engine

        def copy_scripts_kept(save_path: str) -> None:
            if self.error is not None:
                return
            try:
                fault_point("save.recovery_scripts", self.rank, self.step)
                copy_scripts(save_path)
            except OSError as e:
                self.error = f"rank {self.rank}: copying DeepSpeed's zero_to_fp32.py: {e}"

        engine._copy_recovery_script = copy_scripts_kept
        try:
            yield
        finally:
            engine.checkpoint_engine = inner
            del engine._copy_recovery_script  # the class's method again


class _Recorder:
    """DeepSpeed's checkpoint engine with ``save`` going through :meth:`RankFiles.write`."""

    def __init__(self, inner: Any, writes: RankFiles) -> None:
        self._inner, self._writes = inner, writes

    def save(self, state_dict: Any, path: str) -> None:
        first = not self._writes.entries
        self._writes.write(Path(path), lambda p: self._inner.save(state_dict, str(p)))
        if first:
            fault_point("save.between_shards", self._writes.rank, self._writes.step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
