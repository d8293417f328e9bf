"""Which checkpoint a start resumes (``checkpoint/timeline.py``), and what a resume may not change
(``checkpoint/compat.py``), on checkpoint directories written without training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrain.checkpoint.catalog import set_aside_newer
from moetrain.checkpoint.compat import fixed_keys, mtp_chain_note, resume_conflicts
from moetrain.checkpoint.format import COMMIT_FILE, CheckpointError, TrainerState
from moetrain.checkpoint.timeline import TIMELINES_FILE, plan_resume, record_timeline
from moetrain.config import ConfigError
from moetrain.model import Transformer
from moetrain.model.mtp import MTP_CHAIN
from moetrain.train.loop import run_training
from moetrain.train.start import check_start, resume_candidate
from tests.helpers.configs import tiny_config


def _ckpt(root: Path, step: int, marker: str = "") -> Path:
    """A complete-looking checkpoint directory (a commit marker, nothing else)."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / COMMIT_FILE).write_text(json.dumps({"step": step, "files": {}, "m": marker}))
    return path


def _rollback(root: Path, start: Path, step: int) -> None:
    """What a load of a new ``checkpoint.resume=PATH`` records, in its order."""
    record_timeline(root, start, step, set_aside_newer(root, step))


def test_without_a_record_auto_takes_the_newest(tmp_path) -> None:
    root = tmp_path / "run" / "checkpoints"
    _ckpt(root, 2), _ckpt(root, 4)
    assert plan_resume("auto", root).path == root / "step_00000004"
    assert plan_resume("none", root).path is None
    plan = plan_resume(str(root / "step_00000002"), root)
    assert plan.new and plan.path == root / "step_00000002"


def test_the_same_rollback_command_continues_its_timeline(tmp_path) -> None:
    """resume=step_4 over steps 2, 4, 6: a new timeline; once it saved 5 and 6 the same
    command (a restart) continues at its step 6, not at step 4 again, and so does auto."""
    root = tmp_path / "run" / "checkpoints"
    for s in (2, 4, 6):
        _ckpt(root, s)
    four = str(root / "step_00000004")
    assert plan_resume(four, root).new
    _rollback(root, root / "step_00000004", 4)
    assert (root / "abandoned" / "after_step_4" / "step_00000006").is_dir()
    # a restart before the new timeline saved: its start again, no new timeline
    plan = plan_resume(four, root)
    assert (plan.path, plan.new, plan.continues["number"]) == (root / "step_00000004", False, 1)
    _ckpt(root, 5, "new"), _ckpt(root, 6, "new")
    for mode in (four, "auto"):
        plan = plan_resume(mode, root)
        assert (plan.path, plan.new) == (root / "step_00000006", False), mode
    # retention deleted the start: the same command still continues the timeline
    for p in (root / "step_00000004").iterdir():
        p.unlink()
    (root / "step_00000004").rmdir()
    assert plan_resume(four, root).path == root / "step_00000006"
    # another checkpoint is another rollback
    assert plan_resume(str(root / "step_00000005"), root).new


def test_a_timeline_started_outside_the_run_continues_before_its_first_save(tmp_path) -> None:
    """resume=PATH to another run's (or an abandoned) checkpoint, then a crash before the
    first save: auto continues PATH, not the run_dir's own older step_2."""
    root = tmp_path / "run" / "checkpoints"
    _ckpt(root, 2)
    other = _ckpt(tmp_path / "other" / "checkpoints", 5)
    _rollback(root, other, 5)
    assert plan_resume("auto", root).path == other
    assert plan_resume(str(other), root).path == other
    _ckpt(root, 6)
    assert plan_resume("auto", root).path == root / "step_00000006"
    # the path rewritten with another checkpoint: not the timeline's start any more
    (other / COMMIT_FILE).write_text(json.dumps({"step": 5, "files": {}, "m": "rewritten"}))
    assert plan_resume(str(other), root).new


def test_a_timeline_whose_start_is_gone_is_a_clear_error(tmp_path) -> None:
    root = tmp_path / "run" / "checkpoints"
    other = _ckpt(tmp_path / "other", 5)
    _rollback(root, other, 5)
    (other / COMMIT_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"{TIMELINES_FILE}: timeline 1 starts at"):
        plan_resume("auto", root)


def _saved(tmp_path: Path, **settings) -> tuple[Path, object]:
    """run_dir with a checkpoint whose resolved config is the tiny model with ``settings``."""
    cfg = tiny_config({"run_dir": str(tmp_path / "run")}, **settings)
    path = tmp_path / "run" / "checkpoints" / "step_00000002"
    path.mkdir(parents=True)
    state = TrainerState(2, 0, 0, None, None, {}, cfg.to_dict(), tokenizer_sha256="a" * 64)
    (path / "trainer_state.json").write_text(json.dumps(state.to_json()))
    (path / COMMIT_FILE).write_text(json.dumps({"step": 2, "files": {}}))
    return path, cfg


def test_a_resume_that_changes_the_function_is_refused_naming_every_key(tmp_path) -> None:
    path, cfg = _saved(tmp_path)
    changed = tiny_config(
        {"run_dir": str(tmp_path / "run")},
        {"model.rope_theta": 500000.0, "model.sliding_window": 8, "train.precision": "bf16"},
        {"optim.lr": 1e-2, "train.max_steps": 50, "moe.capacity_factor": 1.5},  # may change
    )
    assert resume_candidate(changed) == path
    with pytest.raises(ConfigError) as e:
        check_start(changed)
    msg = str(e.value)
    assert f"checkpoint.resume: {path} cannot be continued" in msg
    assert "model.rope_theta: the checkpoint has 10000.0, the config sets 500000.0" in msg
    assert "model.sliding_window: the checkpoint has None, the config sets 8" in msg
    assert "train.precision: the checkpoint has 'fp32', the config sets 'bf16'" in msg
    for allowed in ("optim.lr", "train.max_steps", "moe.capacity_factor"):
        assert allowed not in msg
    # the command refuses it before any process group starts, writing nothing
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="model.rope_theta: the checkpoint has"):
        run_training(changed)
    assert not dist.is_initialized()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    check_start(cfg)  # the same config resumes
    # --reset-optimizer reads no optimizer file: the precision may change
    precision = tiny_config({"run_dir": str(tmp_path / "run"), "train.precision": "bf16"})
    check_start(precision, reset_optimizer=True)
    with pytest.raises(ConfigError, match="model.mtp_depth: the checkpoint has 0, the config"):
        check_start(tiny_config({"run_dir": str(tmp_path / "run"), "model.mtp_depth": 1}))
    with pytest.raises(ConfigError, match="model.d_model: the checkpoint has"):
        check_start(tiny_config({"run_dir": str(tmp_path / "run"), "model.d_model": 96}))


def test_keys_the_data_position_depends_on_and_the_tokenizer(tmp_path, monkeypatch) -> None:
    path, cfg = _saved(tmp_path)
    with pytest.raises(ConfigError, match=r"seed: the checkpoint has \d+, the config sets 7"):
        check_start(tiny_config({"run_dir": str(tmp_path / "run"), "seed": 7}))
    monkeypatch.setattr("moetrain.train.start.prepared_tokenizer_sha256", lambda _d: "b" * 64)
    with pytest.raises(ConfigError, match=f"tokenized with sha256 {'a' * 64}, this run's"):
        check_start(cfg)
    state = TrainerState.read(path)
    assert resume_conflicts(cfg, state.config, "a" * 64, None) == []  # data not prepared yet


def test_every_function_key_is_fixed_and_a_key_an_older_checkpoint_lacks_is_its_default() -> None:
    cfg = tiny_config()
    assert {"model.rope_theta", "model.mtp_depth", "moe.top_k", "moe.score_func"} <= set(
        fixed_keys()
    )
    saved = cfg.to_dict()
    del saved["model"]["attn_temperature_floor"]  # written before the key existed
    assert resume_conflicts(cfg, saved, None, None) == []
    saved["model"]["rope_interleave"] = True
    assert resume_conflicts(cfg, saved, None, None) == [
        "model.rope_interleave: the checkpoint has True, the config sets False"
    ]


def test_a_checkpoint_trained_with_the_old_mtp_chaining_says_what_changed() -> None:
    two = tiny_config(model__mtp_depth=2).to_dict()
    note = mtp_chain_note(two, None)
    assert note is not None and "depths 2 to 2 compute another function" in note
    assert mtp_chain_note(two, MTP_CHAIN) is None
    assert mtp_chain_note(tiny_config(model__mtp_depth=1).to_dict(), None) is None


def test_mtp_chaining_is_recorded_in_a_written_checkpoint(tmp_path) -> None:
    from moetrain.checkpoint.write import write_checkpoint

    cfg = tiny_config()
    model = Transformer(cfg.model, cfg.moe)
    state = model.state_dict()
    ckpt = write_checkpoint(tmp_path / "c", cfg, [("dense", dict(state))])
    assert TrainerState.read(ckpt).mtp_chain == MTP_CHAIN
