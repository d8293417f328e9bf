"""tests/helpers/configs.py: the tiny model in-process and on the command line is one model."""

from __future__ import annotations

import pytest

from moetrain.config import ConfigError, load_config
from tests.helpers.configs import CLI_MODEL, TINY, cli_args, tiny_args, tiny_config
from tests.helpers.launch import CONFIG


def test_tiny_config_is_the_defaults_with_tiny() -> None:
    cfg = tiny_config()
    assert cfg == load_config(None, [f"{k}={v}" for k, v in TINY.items()])
    assert cfg.model.d_model == TINY["model.d_model"]


def test_override_forms_agree_and_apply_in_order() -> None:
    want = load_config(None, [*tiny_args(), "moe.top_k=1", "model.qk_norm=true", "seed=7"])
    assert tiny_config("moe.top_k=1", "model.qk_norm=true", "seed=7") == want
    assert tiny_config({"moe.top_k": 1, "model.qk_norm": True}, seed=7) == want
    assert tiny_config(moe__top_k=1, model__qk_norm=True, seed=7) == want
    assert tiny_config("moe.top_k=1", {"moe.top_k": 2}, moe__top_k=1).moe.top_k == 1
    assert tiny_config("moe.top_k=1", {"moe.top_k": 2}).moe.top_k == 2


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"moe.top_k": 1, "model.n_layers": 3, "model.qk_norm": True},
        {"model.norm_eps": 1e-6, "moe.shared_expert_hidden": None, "run_dir": "/tmp/a b"},
    ],
)
def test_command_line_overrides_give_the_same_model_on_the_shipped_config(overrides) -> None:
    """On configs/tiny-cpu.yaml (what the CLI tests start from) as on the defaults."""
    for base in (None, CONFIG):
        cfg = load_config(base, tiny_args(overrides))
        assert (cfg.model, cfg.moe) == (tiny_config(overrides).model, tiny_config(overrides).moe)
        assert cfg.data.seq_len == tiny_config(overrides).data.seq_len
    assert load_config(None, tiny_args(overrides)) == tiny_config(overrides)


def test_cli_args_are_tiny_args_with_the_cli_model_and_run_settings() -> None:
    cfg = load_config(CONFIG, cli_args("train.max_steps=6"))
    assert cfg.model == tiny_config(CLI_MODEL).model and cfg.moe == tiny_config(CLI_MODEL).moe
    assert (cfg.data.num_proc, cfg.train.log_every, cfg.train.max_steps) == (1, 1, 6)


def test_bad_overrides_are_config_errors_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="moe.top_k"):
        tiny_config(moe__top_k=9)
    with pytest.raises(ConfigError, match="model.bogus"):
        tiny_config({"model.bogus": 1})
