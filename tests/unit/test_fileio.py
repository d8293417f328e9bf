"""moetrain.fileio: a directory built beside its destination is installed durably: every file
and directory in it (nested ones too) fsynced before the rename, the parent after it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moetrain import fileio


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths os.fsync is called on, in order (read back from the file descriptor)."""
    seen: list[Path] = []
    real = os.fsync

    def record(fd: int) -> None:
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(fileio.os, "fsync", record)
    return seen


def test_installed_tree_is_fsynced_below_the_top_level(tmp_path: Path, fsynced) -> None:
    out = tmp_path / "shards"
    with fileio.building_dir(out) as tmp:
        (tmp / "index.json").write_text("{}")
        (tmp / "tokenizer" / "extra").mkdir(parents=True)
        (tmp / "tokenizer" / "tokenizer.json").write_text("{}")
        (tmp / "tokenizer" / "extra" / "notes.txt").write_text("x")
        building = tmp
    synced = [p.relative_to(building) if p.is_relative_to(building) else p for p in fsynced]
    for rel in ("index.json", "tokenizer/tokenizer.json", "tokenizer/extra/notes.txt"):
        assert Path(rel) in synced, synced
    for rel in ("tokenizer/extra", "tokenizer"):  # directories, after their entries
        assert synced.index(Path(rel)) > synced.index(Path(rel) / os.listdir(out / rel)[0])
    assert synced.index(Path(".")) > max(synced.index(Path("tokenizer")), 0)
    assert fsynced[-1] == tmp_path  # the parent, after the rename
    assert (out / "tokenizer" / "extra" / "notes.txt").read_text() == "x"


def test_replacing_fsyncs_the_parent_after_removing_the_old_tree(tmp_path: Path, fsynced) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with fileio.building_dir(out, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(os.listdir(out)) == ["new.txt"]
    assert [p for p in os.listdir(tmp_path) if p != "model"] == []  # nothing moved aside left
    assert fsynced[-2:] == [tmp_path, tmp_path]  # after the rename, and after the removal
