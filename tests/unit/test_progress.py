"""A run's progress: one dataclass whose state dict is what trainer_state.json holds of it."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from moetrain.checkpoint.format import PROGRESS_FIELDS, TrainerState
from moetrain.train.progress import Progress


def test_advance_counts_steps_tokens_and_each_kind_of_skip() -> None:
    p = Progress()
    p.advance(100, skipped=False, calibration=False)
    p.advance(100, skipped=True, calibration=False)
    p.advance(100, skipped=True, calibration=True)
    assert (p.step, p.tokens_seen, p.skipped_steps, p.loss_scale_overflows) == (3, 300, 1, 1)


def test_state_dict_round_trips_through_json_and_is_a_copy() -> None:
    p = Progress(step=7, tokens_seen=70, skipped_steps=1, loss_scale_overflows=2, init={"a": [1]})
    state = json.loads(json.dumps(p.state_dict()))
    q = Progress()
    q.load_state_dict(state)
    assert q == p
    state["init"]["a"].append(2)
    assert q.init == {"a": [1]}  # loading copied it


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_load_refuses_other_keys(change: str) -> None:
    state = Progress().state_dict()
    if change == "missing":
        del state["tokens_seen"]
    else:
        state["epoch"] = 1
    with pytest.raises(ValueError, match="progress state"):
        Progress().load_state_dict(state)


def test_trainer_state_holds_exactly_the_progress_fields() -> None:
    assert tuple(f.name for f in fields(Progress)) == PROGRESS_FIELDS
    p = Progress(step=3, tokens_seen=30, skipped_steps=1, loss_scale_overflows=0, init=None)
    state = TrainerState(**p.state_dict(), loader=None, schedule=None, layout={}, config={})
    assert state.progress() == p.state_dict()
