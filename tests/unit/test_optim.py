"""Optimizers by name (the registry, AdamW's parameter groups) and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import OptimConfig
from moetrain.model.transformer import Transformer
from moetrain.optim.groups import decay_groups as param_groups
from moetrain.optim.schedule import LRSchedule, lr_factor, warmup_steps_for
from tests.helpers.configs import tiny_config


def _opt(**kw) -> OptimConfig:
    base = dict(lr=1.0, min_lr_ratio=0.1, warmup_steps=10)
    base.update(kw)
    return OptimConfig(**base)


@pytest.mark.parametrize(
    "step,expected",
    [(0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (55, 0.1 + 0.9 * 0.5), (100, 0.1), (150, 0.1)],
)
def test_cosine(step: int, expected: float) -> None:
    # decay runs from step 10 (factor 1) to the last step 100 (factor min_lr_ratio)
    assert lr_factor(step, 101, 10, _opt(schedule="cosine")) == pytest.approx(expected)


def test_cosine_intermediate_point() -> None:
    # step 32 is 22 of the 90 decay steps in
    want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 22 / 90))
    assert lr_factor(32, 101, 10, _opt(schedule="cosine")) == pytest.approx(want)


@pytest.mark.parametrize("step,expected", [(0, 0.1), (10, 1.0), (55, 0.55), (100, 0.1)])
def test_linear(step: int, expected: float) -> None:
    assert lr_factor(step, 101, 10, _opt(schedule="linear")) == pytest.approx(expected)


@pytest.mark.parametrize("step,expected", [(2, 0.3), (10, 1.0), (100, 1.0)])
def test_constant(step: int, expected: float) -> None:
    assert lr_factor(step, 101, 10, _opt(schedule="constant")) == pytest.approx(expected)


@pytest.mark.parametrize(
    "step,expected",
    # 100 steps, decay over the last 20 (steps 80..99): stable until 79, min at 99
    [(5, 0.6), (10, 1.0), (79, 1.0), (80, 1.0 - 0.9 / 20), (89, 1.0 - 0.9 * 10 / 20), (99, 0.1)],
)
def test_wsd(step: int, expected: float) -> None:
    opt = _opt(schedule="wsd", decay_fraction=0.2)
    assert lr_factor(step, 100, 10, opt) == pytest.approx(expected)


def test_no_warmup_starts_at_peak() -> None:
    assert lr_factor(0, 50, 0, _opt(schedule="cosine", warmup_steps=0)) == pytest.approx(1.0)


def test_warmup_in_tokens() -> None:
    opt = _opt(warmup_tokens=10_000)
    assert warmup_steps_for(opt, 1024) == 10  # ceil(10000 / 1024)
    assert warmup_steps_for(_opt(), 1024) == 10  # steps when tokens are not set


def test_schedule_drives_optimizer_lr() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=123.0)
    sched = LRSchedule(opt, _opt(lr=2.0, schedule="linear", warmup_steps=2), 5, 0)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    # warmup 1.0, 2.0; then linear 2.0 -> 0.2 over steps 2..4
    assert seen == pytest.approx([1.0, 2.0, 2.0, 1.1, 0.2])
    state = sched.state_dict()
    other = LRSchedule(opt, _opt(lr=2.0, schedule="linear", warmup_steps=2), 5, 0)
    other.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.get_last_lr()[0])


def _tiny_model(**overrides: object) -> Transformer:
    cfg = tiny_config(
        {"model.dense_hidden": 1024, "model.max_seq_len": 2048, "moe.first_k_dense": 1}, overrides
    )
    return Transformer(cfg.model, cfg.moe)


def _names(model: torch.nn.Module, group: dict) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_param_groups_decay_rules() -> None:
    model = _tiny_model()
    groups = {g["name"]: g for g in param_groups(model, _opt(weight_decay=0.1))}
    assert set(groups) == {"decay", "no_decay"}  # no expert markers: no MoE group
    no_decay = _names(model, groups["no_decay"])
    decay = _names(model, groups["decay"])
    assert "embed.weight" in no_decay
    assert {"norm.weight", "layers.0.attn_norm.weight", "layers.1.ffn_norm.weight"} <= no_decay
    assert {"lm_head.weight", "layers.0.attn.wq.weight", "layers.1.ffn.router.gate.weight"} <= decay
    assert "layers.1.ffn.experts.w13" in decay
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    every = {n for n, _ in model.named_parameters()}
    assert decay | no_decay == every and not decay & no_decay


def test_decay_embeddings_option() -> None:
    model = _tiny_model()
    groups = {g["name"]: g for g in param_groups(model, _opt(decay_embeddings=True))}
    assert "embed.weight" in _names(model, groups["decay"])


def test_expert_params_get_their_own_moe_group() -> None:
    model = _tiny_model()
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.allreduce = False
            p.group_name = "ep_size_2"
    groups = param_groups(model, _opt())
    moe = [g for g in groups if g.get("moe")]
    assert len(moe) == 1 and moe[0]["name"] == "ep_size_2"
    assert _names(model, moe[0]) == {f"layers.1.ffn.experts.{w}" for w in ("w13", "w2")}
    assert moe[0]["weight_decay"] == 0.1
    dense = [g for g in groups if not g.get("moe")]
    assert all(".experts." not in n for g in dense for n in _names(model, g))


def _fake_fused_adam(monkeypatch: pytest.MonkeyPatch, error: Exception | None) -> None:
    import sys
    import types

    class FusedAdam(torch.optim.AdamW):
        def __init__(self, groups, adam_w_mode, weight_decay, **kw):  # noqa: ANN001
            if error is not None:
                raise error
            super().__init__(groups, weight_decay=weight_decay, **kw)

    monkeypatch.setitem(
        sys.modules, "deepspeed.ops.adam", types.SimpleNamespace(FusedAdam=FusedAdam)
    )


@pytest.mark.parametrize("builds", [True, False], ids=["fused_adam", "build_fails"])
def test_the_optimizer_that_runs_is_logged(
    builds: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from moetrain.optim.registry import build_optimizer

    _fake_fused_adam(monkeypatch, None if builds else RuntimeError("nvcc not found"))
    opt = build_optimizer(_tiny_model(), _opt(), torch.device("cuda"))
    err = capsys.readouterr().out  # the run's console channel is stdout
    if builds:
        assert type(opt).__name__ == "FusedAdam"
        assert err == "moetrain: optimizer: DeepSpeed FusedAdam\n"
    else:
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
        assert "FusedAdam could not be built (RuntimeError: nvcc not found)" in err
        assert "using torch.optim.AdamW(fused=True)" in err
    build_optimizer(_tiny_model(), _opt(), torch.device("cpu"))
    assert capsys.readouterr().out == "moetrain: optimizer: torch.optim.AdamW(fused=True)\n"


def test_config_offers_every_registered_optimizer() -> None:
    import typing

    from moetrain.optim.registry import OPTIMIZERS

    choices = typing.get_args(typing.get_type_hints(OptimConfig)["name"])
    assert set(choices) == set(OPTIMIZERS) and OptimConfig().name == "adamw"


def test_unknown_optimizer_is_refused_naming_the_key() -> None:
    from moetrain.config import ConfigError
    from moetrain.optim.registry import optimizer_spec

    with pytest.raises(ConfigError, match="optim.name: unknown optimizer 'sgd'; known: adamw"):
        optimizer_spec("sgd")
    with pytest.raises(ConfigError, match="optim.name"):
        tiny_config({"optim.name": "sgd"})


def test_a_resume_under_another_optimizer_is_refused_before_it_starts(tmp_path) -> None:
    """``optim.name`` is one of the keys a resume may change only with ``--reset-optimizer``
    (checkpoint/compat.py), refused before any process group starts; a checkpoint written
    before the name was recorded is AdamW's."""
    import json

    from moetrain.checkpoint.format import COMMIT_FILE, TrainerState
    from moetrain.checkpoint.reshard import saved_optimizer_name
    from moetrain.config import ConfigError
    from moetrain.train.start import check_start

    run = {"run_dir": str(tmp_path / "run")}
    saved = tiny_config(run).to_dict()
    del saved["optim"]["name"]  # (written before the name was recorded)
    path = tmp_path / "run" / "checkpoints" / "step_00000002"
    path.mkdir(parents=True)
    state = TrainerState(2, 0, 0, None, None, {}, saved)
    (path / "trainer_state.json").write_text(json.dumps(state.to_json()))
    (path / COMMIT_FILE).write_text(json.dumps({"step": 2, "files": {}}))
    assert saved_optimizer_name(state) == "adamw"
    check_start(tiny_config(run))
    muon = tiny_config({**run, "optim.name": "muon"})
    with pytest.raises(ConfigError) as e:
        check_start(muon)
    assert "optim.name: the checkpoint has 'adamw', the config sets 'muon'" in str(e.value)
    assert "(for optim.name alone: --reset-optimizer)" in str(e.value)
    check_start(muon, reset_optimizer=True)
