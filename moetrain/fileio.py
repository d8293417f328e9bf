"""Atomic writes and fsync: the one implementation, used by checkpoints, data and conversion.

A file is written to a hidden temporary name beside its destination, fsynced and renamed, so a
reader sees the old file or the whole new one. A directory is built as a hidden temporary
directory beside its destination (``.<name>.tmp-<host>-<pid>-<rand>``), its files fsynced, then
renamed into place (:func:`install_dir`); what a dead writer left is found by
:func:`remove_stale_temp_dirs`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; on success it is flushed, fsynced
    and renamed to ``path`` (then the directory is fsynced); on error it is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


def write_json_atomic(path: str | Path, obj: Any, sort_keys: bool = True) -> None:
    """JSON (indent 2, a final newline) to ``path``, atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def _sibling(final: Path, kind: str) -> Path:
    tag = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
    return final.parent / f".{final.name}.{kind}-{tag}"


def new_temp_dir(final: str | Path) -> Path:
    """An empty hidden directory beside ``final`` to build it in (parents created)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(final, "tmp")
    tmp.mkdir()
    return tmp


def fsync_tree(root: Path) -> None:
    """fsync every file below ``root`` and every directory, ``root`` last (a directory after
    its entries): after it returns, the whole tree survives a power loss."""
    for parent, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(parent) / name)
        fsync_dir(Path(parent))


def install_dir(tmp: Path, final: str | Path, replace: bool = False) -> None:
    """Make the finished directory ``tmp`` appear as ``final``: everything in it (subdirectories
    too) and itself fsynced, then one rename, then the parent fsynced. An existing ``final`` is
    an error unless ``replace``; then it is moved aside first and removed after the rename (the
    removal fsynced too)."""
    final = Path(final)
    fsync_tree(tmp)
    old = None
    if final.exists():
        if not replace:
            raise FileExistsError(f"{final}: already exists")
        old = _sibling(final, "old")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(final.parent)


@contextmanager
def building_dir(final: str | Path, replace: bool = False) -> Iterator[Path]:
    """``with building_dir(out) as tmp:`` write into ``tmp``; installed as ``out`` when the
    block ends normally, removed when it raises."""
    tmp = new_temp_dir(final)
    try:
        yield tmp
        install_dir(tmp, final, replace)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(final: str | Path) -> list[Path]:
    """Remove the temporary / moved-aside directories of ``final`` left by dead writers: those of
    this host whose process is gone, and other hosts' after a day (a writer on another node may
    still be alive on a shared filesystem)."""
    final = Path(final)
    removed = []
    host = socket.gethostname()
    for p in final.parent.glob(f".{final.name}.*-*"):
        parts = p.name[len(final.name) + 2 :].split("-")
        if parts[0] not in ("tmp", "old") or len(parts) < 4:
            continue
        p_host, p_pid = "-".join(parts[1:-2]), parts[-2]
        if p_host == host and p_pid.isdigit() and _pid_alive(int(p_pid)):
            continue
        if p_host != host and time.time() - p.stat().st_mtime < 86400:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def file_crc32(path: str | Path) -> int:
    """CRC-32 of a file's bytes: a cheap check that it is the file that was committed."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
