"""WandbSink through the real wandb library, offline only (never touches the network)."""

import builtins
import sys

import matplotlib
import matplotlib.font_manager  # noqa: F401  (load the font cache before HOME moves)
import numpy as np
import pytest
import torch

from moetrain.config import Config, WandbConfig, config_from_dict
from moetrain.monitor.wandb_run import (
    REDACTED,
    WandbSink,
    is_secret_key,
    offline_run_dirs,
    read_run_records,
    redact,
    resolve_mode,
)
from tests.helpers.configs import tiny_config

SENTINEL = "SENTINELkey0123456789abcdefSENTINEL"


@pytest.fixture
def wandb_env(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("MPLCONFIGDIR", matplotlib.get_configdir())
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", SENTINEL)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    return home


def _history(records):
    return [r["history"] for r in records if r["type"] == "history"]


def _files_containing(root, needle: bytes):
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_offline_run_readback_steps_and_no_secret(wandb_env, tmp_path):
    run_dir = tmp_path / "run"
    config = Config().to_dict()
    config["logging"]["hf_token"] = "hf_abcdefgh12345"
    config["notes"] = f"launched with key {SENTINEL}"
    msgs: list[str] = []
    cfg = WandbConfig(mode="offline", project="proj", name="n1", tags=["a", "b"])
    sink = WandbSink(cfg, run_dir, config=config, rank=0, printer=msgs.append)
    assert sink.active and sink.mode == "offline" and sink.run_id
    for step in range(5):
        logged = sink.log(
            {
                "step": step,
                "loss": 5.0 - step,
                "lr": torch.tensor(1e-3),
                "moe/layer0/tokens_per_expert": [1, 2, 3],  # list: JSONL only
                "bad": float("nan"),
                "note": "text",  # strings are not logged
            },
            step,
        )
        assert logged
    assert sink.log_heatmap(np.array([[10, 20, 30, 40], [25, 25, 25, 25]]), step=4)
    assert not sink.log({"loss": 9.0}, step=2)  # backwards: dropped
    assert not sink.log({"loss": 9.0}, step=3)
    assert sink.dropped_steps == 2
    assert sum("dropping step" in m for m in msgs) == 1  # warned once
    sink.finish()
    sink.finish()  # idempotent

    (run,) = offline_run_dirs(run_dir)
    assert sink.run_id in run.name
    records = read_run_records(run)
    run_rec = next(r["run"] for r in records if r["type"] == "run")
    assert run_rec["run_id"] == sink.run_id and run_rec["project"] == "proj"
    history = _history(records)
    assert [h["step"]["num"] for h in history] == [0, 1, 2, 3, 4]
    items = {h["step"]["num"]: h["item"] for h in history}
    assert items[2]["loss"] == 3 and items[0]["lr"] == pytest.approx(1e-3)
    assert all("moe/layer0/tokens_per_expert" not in it for it in items.values())
    assert all("note" not in it and "step" not in it for it in items.values())
    assert items[0]["bad"] == "NaN"  # divergence stays visible in wandb
    assert items[4]["loss"] == 1  # heatmap at the same step joined this row
    assert items[4]["moe/expert_load_heatmap._type"] == "image-file"
    assert (run / "files" / items[4]["moe/expert_load_heatmap.path"]).stat().st_size > 0

    logged_cfg = run_rec["config"]["update"]
    assert logged_cfg["logging"]["hf_token"] == REDACTED
    assert logged_cfg["notes"] == REDACTED
    assert logged_cfg["train"]["max_tokens"] is None  # "tokens" is not a secret
    assert logged_cfg["model"]["d_model"] == Config().model.d_model
    assert _files_containing(run_dir, SENTINEL.encode()) == []
    assert _files_containing(run_dir, b"hf_abcdefgh12345") == []
    assert not any(SENTINEL in m for m in msgs)


def test_nonzero_rank_creates_nothing(wandb_env, tmp_path):
    msgs: list[str] = []
    sink = WandbSink(WandbConfig(mode="offline"), tmp_path / "run", rank=1, printer=msgs.append)
    assert not sink.active and sink.run_id is None
    assert not sink.log({"loss": 1.0}, 1) and not sink.log_heatmap([[1, 2]], 1)
    sink.finish()
    assert not (tmp_path / "run").exists() and msgs == []


def test_resume_continues_same_run_id(wandb_env, tmp_path):
    run_dir = tmp_path / "run"
    first = WandbSink(WandbConfig(mode="offline"), run_dir, rank=0, printer=lambda m: None)
    first.log({"loss": 2.0}, 10)
    run_id = first.run_id
    first.finish()
    second = WandbSink(
        WandbConfig(mode="offline"), run_dir, rank=0, resume_id=run_id, printer=lambda m: None
    )
    assert second.run_id == run_id
    second.log({"loss": 1.5}, 11)
    second.finish()
    runs = offline_run_dirs(run_dir)
    assert len(runs) == 2 and all(run_id in r.name for r in runs)
    records = read_run_records(runs[1])
    run_rec = next(r["run"] for r in records if r["type"] == "run")
    assert run_rec["run_id"] == run_id and run_rec["resume"] is True
    assert [h["step"]["num"] for h in _history(records)] == [11]


def test_mode_resolution():
    cfg = WandbConfig(mode="online")
    assert resolve_mode(cfg, {})[0] == "online"
    assert resolve_mode(cfg, {"WANDB_MODE": "offline"}) == (
        "offline",
        "WANDB_MODE=offline in the environment",
    )
    assert resolve_mode(cfg, {"WANDB_MODE": "dryrun"})[0] == "offline"
    assert resolve_mode(cfg, {"WANDB_DISABLED": "true"})[0] == "disabled"
    fixed = WandbConfig(mode="disabled", respect_env_mode=False)
    assert resolve_mode(fixed, {"WANDB_MODE": "online"}) == (
        "disabled",
        "logging.wandb.mode=disabled",
    )


def test_redaction():
    assert is_secret_key("api_key") and is_secret_key("WANDB_API_KEY") and is_secret_key("hfToken")
    assert is_secret_key("db-password") and is_secret_key("apikey")
    assert not is_secret_key("max_tokens") and not is_secret_key("tokenizer_model")
    assert not is_secret_key("top_k") and not is_secret_key("shard_tokens")
    data = {"a": {"secret": "x", "token": None, "path": "/p/s3cr3tvalue!"}, "l": ["s3cr3tvalue!"]}
    assert redact(data, ["s3cr3tvalue!"]) == {
        "a": {"secret": REDACTED, "token": None, "path": REDACTED},
        "l": [REDACTED],
    }


def test_redaction_keeps_sizes_under_key_named_settings():
    """Gated DeltaNet's head counts and dims (``linear_num_key_heads``, ``linear_key_head_dim``)
    are numbers: a checkpoint's or run's redacted config still builds the same model."""
    cfg = tiny_config(
        {
            "model.full_attention_interval": 2,
            "model.linear_num_key_heads": 2,
            "model.linear_num_value_heads": 4,
            "model.linear_key_head_dim": 8,
            "model.linear_value_head_dim": 8,
        }
    )
    assert is_secret_key("linear_key_head_dim")  # (the name alone looks secret)
    assert config_from_dict(redact(cfg.to_dict(), [])) == cfg
    assert redact({"api_key": "abc", "auth": {"user": "u"}}, []) == {
        "api_key": REDACTED,
        "auth": REDACTED,
    }


def test_disabled_says_so_once(wandb_env, tmp_path, monkeypatch):
    msgs: list[str] = []
    cfg = WandbConfig(mode="disabled", respect_env_mode=False)  # env says offline; config wins
    sink = WandbSink(cfg, tmp_path / "a", rank=0, printer=msgs.append)
    assert not sink.active and not sink.log({"loss": 1.0}, 1)
    sink.finish()
    assert len(msgs) == 1 and "disabled (logging.wandb.mode=disabled)" in msgs[0]
    monkeypatch.setenv("WANDB_MODE", "disabled")  # environment wins over mode=offline
    msgs.clear()
    sink = WandbSink(WandbConfig(mode="offline"), tmp_path / "b", rank=0, printer=msgs.append)
    assert not sink.active and len(msgs) == 1 and "WANDB_MODE=disabled" in msgs[0]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_unavailable_wandb_does_not_fail(wandb_env, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    msgs: list[str] = []
    sink = WandbSink(
        WandbConfig(mode="offline"), tmp_path, rank=0, resume_id="abc", printer=msgs.append
    )
    assert not sink.active and sink.run_id == "abc"  # id kept for the next checkpoint
    assert not sink.log({"loss": 1.0}, 1)
    sink.finish()
    assert len(msgs) == 1 and "unavailable" in msgs[0]


def test_init_failure_and_missing_key(wandb_env, tmp_path, monkeypatch):
    import wandb

    modes: list[str] = []

    def failing_init(mode, **kwargs):
        modes.append(mode)
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb, "init", failing_init)
    msgs: list[str] = []
    sink = WandbSink(WandbConfig(mode="offline"), tmp_path, rank=0, printer=msgs.append)
    assert not sink.active and modes == ["offline"]
    assert len(msgs) == 1 and "offline init failed (RuntimeError: no network)" in msgs[0]

    # online without credentials: no prompt, no network; falls back to offline (which fails here)
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setattr(wandb, "login", lambda **kw: False)
    modes.clear()
    msgs.clear()
    sink = WandbSink(
        WandbConfig(mode="online", respect_env_mode=False), tmp_path, rank=0, printer=msgs.append
    )
    assert modes == ["offline"] and not sink.active
    assert "no API key" in msgs[0] and "continuing without wandb" in msgs[1] and len(msgs) == 2
