"""Checkpoint bookkeeping: commit markers, discovery, retention, safe loading, secrets."""

import os
import pickle

import pytest
import torch

from moetrain.checkpoint.catalog import (
    apply_retention,
    complete_checkpoints,
    latest_complete,
    remove_incomplete,
    set_aside_newer,
)
from moetrain.checkpoint.format import (
    COMMIT_FILE,
    CheckpointError,
    read_commit,
    safe_torch_load,
    tag_for_step,
)
from moetrain.fileio import write_json_atomic


def _make(root, step, complete=True):
    d = root / tag_for_step(step)
    d.mkdir(parents=True)
    (d / "weights.pt").write_bytes(b"x")
    if complete:
        write_json_atomic(d / COMMIT_FILE, {"step": step})
    return d


def test_only_committed_directories_count(tmp_path):
    _make(tmp_path, 5)
    _make(tmp_path, 10)
    _make(tmp_path, 15, complete=False)
    (tmp_path / "latest").write_text("step_00000015")  # DeepSpeed's pointer is ignored
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000005", "step_00000010"]
    assert latest_complete(tmp_path).name == "step_00000010"
    assert read_commit(latest_complete(tmp_path)) == {"step": 10}
    removed = remove_incomplete(tmp_path)
    assert [p.name for p in removed] == ["step_00000015"]
    assert not (tmp_path / "step_00000015").exists()


def test_read_commit_errors(tmp_path):
    d = _make(tmp_path, 1, complete=False)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        read_commit(d)
    (d / COMMIT_FILE).write_text("{trunc")
    with pytest.raises(CheckpointError, match="unreadable commit marker"):
        read_commit(d)


def test_atomic_json_leaves_no_temp_files(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": 1})
    write_json_atomic(tmp_path / "a.json", {"x": 2})
    assert os.listdir(tmp_path) == ["a.json"]


def test_retention_keeps_last_k_and_never_the_newest(tmp_path):
    for s in (1, 2, 3, 4):
        _make(tmp_path, s)
    _make(tmp_path, 5, complete=False)
    deleted, errors = apply_retention(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["step_00000001", "step_00000002"]
    assert errors == []
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert (tmp_path / "step_00000005").exists()  # incomplete ones are not retention's business
    apply_retention(tmp_path, keep_last=0)  # clamped to 1: the newest complete one survives
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000004"]


def test_retention_failure_is_reported_not_raised(tmp_path, monkeypatch):
    for s in (1, 2):
        _make(tmp_path, s)
    import moetrain.checkpoint.catalog as cf

    def boom(path):
        raise PermissionError("read-only")

    monkeypatch.setattr(cf.shutil, "rmtree", boom)
    deleted, errors = apply_retention(tmp_path, keep_last=1)
    assert deleted == [] and "read-only" in errors[0]
    # the uncommitted leftover no longer counts as a checkpoint
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002"]


def test_rollback_sets_the_newer_timeline_aside_and_retention_keeps_the_new_one(tmp_path):
    for s in (100, 200, 300):
        _make(tmp_path, s)
    _make(tmp_path, 400, complete=False)
    moved = set_aside_newer(tmp_path, 100)  # resumed step 100: 200, 300 and 400 are abandoned
    assert moved == tmp_path / "abandoned" / "after_step_100"
    assert sorted(p.name for p in moved.iterdir()) == [
        "step_00000200",
        "step_00000300",
        "step_00000400",
    ]
    assert (moved / "step_00000300" / COMMIT_FILE).is_file()  # kept intact, still complete
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000100"]
    _make(tmp_path, 150)  # the new timeline's first save
    deleted, _ = apply_retention(tmp_path, keep_last=2)
    assert deleted == []  # retention saw step_100 and step_150 only: both stay
    assert latest_complete(tmp_path).name == "step_00000150"  # resume=auto: the new timeline
    assert set_aside_newer(tmp_path, 150) is None  # nothing newer: nothing moves
    # a second rollback to the same step gets its own directory
    _make(tmp_path, 200)
    assert set_aside_newer(tmp_path, 100).name == "after_step_100.1"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000100"]


def test_rollback_and_retention_fsync_the_checkpoint_root(tmp_path, monkeypatch):
    import moetrain.checkpoint.catalog as cf

    synced = []
    monkeypatch.setattr(cf, "fsync_dir", lambda p: synced.append(p))
    for s in (1, 2, 3):
        _make(tmp_path, s)
    dest = set_aside_newer(tmp_path, 1)
    assert synced[-2:] == [dest, tmp_path]  # the new home, then the root the entries left
    synced.clear()
    _make(tmp_path, 4)
    apply_retention(tmp_path, keep_last=1)
    assert synced == [tmp_path]  # the deletions are made durable


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_safe_load_refuses_pickle_payload(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"x": _Payload()}, evil)
    with pytest.raises(CheckpointError, match="refused to load"):
        safe_torch_load(evil)
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match=str(raw.name)):
        safe_torch_load(raw)


def test_safe_load_reports_truncation_and_missing(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(1000.0)}, good)
    assert torch.equal(safe_torch_load(good)["w"], torch.arange(1000.0))
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        safe_torch_load(cut)
    with pytest.raises(CheckpointError, match="missing"):
        safe_torch_load(tmp_path / "nope.pt")
