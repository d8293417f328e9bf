"""The commit manifest: built from every rank's own file list, checked before anything loads.

A file listed at commit that is later missing, truncated or altered (same size, other bytes) is
refused with its name; a write error during a save is kept by the rank that hit it (so all ranks
can agree on it) and nothing after it is written.
"""

import errno
import json

import pytest
import torch

from moetrain.checkpoint.format import (
    COMMIT_FILE,
    CheckpointError,
    file_entry,
    manifest_from,
    manifest_names,
    verify_manifest,
)
from moetrain.checkpoint.rank_files import RankFiles


def _committed(tmp_path):
    """A checkpoint directory whose files were written by two 'ranks', and its manifest."""
    d = tmp_path / "step_00000004"
    d.mkdir()
    torch.save({"w": torch.arange(64.0)}, d / "layer_0_expert_0_mp_rank_00_model_states.pt")
    torch.save({"w": torch.arange(32.0)}, d / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (d / "trainer_state.json").write_text('{"step": 4}\n')
    rank0 = {n: file_entry(d / n) for n in ("layer_0_expert_0_mp_rank_00_model_states.pt",)}
    rank0["trainer_state.json"] = file_entry(d / "trainer_state.json")
    rank1 = {n: file_entry(d / n) for n in ("zero_pp_rank_1_mp_rank_00_optim_states.pt",)}
    manifest = manifest_from(4, [rank0, rank1])
    (d / COMMIT_FILE).write_text(json.dumps(manifest))
    return d, manifest


def test_manifest_lists_every_ranks_files_with_size_checksum_and_writer(tmp_path):
    d, manifest = _committed(tmp_path)
    assert manifest["writers"] == {
        "layer_0_expert_0_mp_rank_00_model_states.pt": 0,
        "trainer_state.json": 0,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,
    }
    for name in manifest["files"]:
        assert manifest["files"][name] == (d / name).stat().st_size
    assert len(set(manifest["crc32"].values())) == 3
    verify_manifest(d)  # untouched: accepted
    assert manifest_names(d) == sorted(manifest["files"])


def test_two_ranks_claiming_one_file_is_an_error():
    with pytest.raises(CheckpointError, match=r"a\.pt written by rank 0 and rank 1"):
        manifest_from(2, [{"a.pt": (1, 2)}, {"a.pt": (1, 2)}])


def test_missing_file_is_refused_by_name(tmp_path):
    d, _ = _committed(tmp_path)
    (d / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*missing"
    ):
        verify_manifest(d)


def test_truncated_file_is_refused_by_name(tmp_path):
    d, _ = _committed(tmp_path)
    f = d / "layer_0_expert_0_mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"layer_0_expert_0_.*size 100 .*truncated"):
        verify_manifest(d)


def test_altered_file_of_the_same_size_is_refused_by_name(tmp_path):
    d, _ = _committed(tmp_path)
    f = d / "trainer_state.json"
    f.write_text('{"step": 5}\n')  # same length, other contents
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: contents changed"):
        verify_manifest(d)
    # A subset check (one rank's share of the reading) only reads its own names.
    verify_manifest(d, ["zero_pp_rank_1_mp_rank_00_optim_states.pt"])


def test_manifest_without_checksums_still_checks_sizes(tmp_path):
    d, manifest = _committed(tmp_path)
    (d / COMMIT_FILE).write_text(json.dumps({"step": 4, "files": manifest["files"]}))
    (d / "trainer_state.json").write_text('{"step": 5}\n')
    verify_manifest(d)  # the older format has no checksums: same size passes
    (d / "trainer_state.json").write_text('{"step": 50}\n')
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        verify_manifest(d)


def test_a_write_error_is_kept_and_stops_further_writes(tmp_path):
    writes = RankFiles(tmp_path, rank=1, step=3)
    writes.write(tmp_path / "a.pt", lambda p: torch.save({"x": torch.ones(3)}, p))

    def disk_full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    writes.write(tmp_path / "b.pt", disk_full)
    writes.write(tmp_path / "c.pt", lambda p: p.write_text("never"))
    writes.finish()
    assert list(writes.entries) == ["a.pt"]
    assert writes.entries["a.pt"] == file_entry(tmp_path / "a.pt")
    assert writes.error.startswith("rank 1: writing b.pt:") and "No space left" in writes.error
    assert not (tmp_path / "c.pt").exists()
