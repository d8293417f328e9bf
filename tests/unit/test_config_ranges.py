"""Every numeric config key declares its valid range, and every enumerated key its choices.

The walk covers every field of every config section (``data.sources`` entries too), so a new
numeric key without a declared range fails here; each range is then proved enforced with a
value just outside each of its ends, refused with an error that names the dotted key.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from moetrain.config import Config, ConfigError, config_from_dict
from moetrain.config.ranges import RANGE, Range

NUMBERS = (int, float)


def _set(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    node = data
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def _plain(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _leaves(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = _plain(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, key)
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            yield from _leaves(typing.get_args(tp)[0], f"{key}[0]")
        else:
            yield key, tp, f


def _data_for(key: str, value: Any) -> dict[str, Any]:
    """A config dict setting ``key`` (a ``data.sources[0]`` key: a one-entry mixture)."""
    if key.startswith("data.sources[0]."):
        entry = {"source": "corpus.jsonl", key.rsplit(".", 1)[1]: value}
        return {"data": {"sources": [entry]}}
    return _set({}, key, value)


NUMERIC = [(k, tp, f) for k, tp, f in _leaves() if tp in NUMBERS]
ENUMERATED = [(k, tp, f) for k, tp, f in _leaves() if typing.get_origin(tp) is Literal]


def test_the_walk_sees_every_section():
    keys = {k for k, _, _ in NUMERIC}
    assert {"train.eval_steps", "checkpoint.save_every_minutes", "seed"} <= keys
    assert {"data.sources[0].weight", "logging.heatmap_every", "moe.top_k"} <= keys
    assert {"train.precision", "data.source_format"} <= {k for k, _, _ in ENUMERATED}


@pytest.mark.parametrize("key, tp, field", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_every_numeric_key_declares_a_range_that_holds_its_default(key, tp, field):
    declared = field.metadata.get(RANGE)
    assert isinstance(declared, Range), f"{key}: no declared range (field metadata {RANGE!r})"
    if field.default is not None and field.default is not dataclasses.MISSING:
        assert declared.contains(field.default), f"{key}: default {field.default} out of range"


def _outside(declared: Range, tp: type) -> list[Any]:
    step = 1 if tp is int else 0.5
    out = []
    if declared.low is not None:
        out.append(declared.low if declared.low_open else declared.low - step)
    if declared.high is not None:
        out.append(declared.high if declared.high_open else declared.high + step)
    if tp is float:
        out.append(float("nan"))
    return [tp(v) if tp is int else v for v in out]


@pytest.mark.parametrize("key, tp, field", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_values_outside_a_range_are_refused_naming_the_key(key, tp, field):
    declared = field.metadata[RANGE]
    values = _outside(declared, tp)
    assert values, f"{key}: a range with no end refuses nothing"
    for value in values:
        with pytest.raises(ConfigError, match=re.escape(key) + ": must be"):
            config_from_dict(_data_for(key, value))


@pytest.mark.parametrize("key, tp, field", ENUMERATED, ids=[k for k, _, _ in ENUMERATED])
def test_enumerated_keys_refuse_other_values_naming_the_key(key, tp, field):
    with pytest.raises(ConfigError, match=re.escape(key) + ": expected '"):
        config_from_dict(_data_for(key, "not-a-choice"))


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.eval_steps", 0),
        ("train.eval_steps", -3),
        ("train.max_nonfinite_in_a_row", 0),
        ("checkpoint.save_every_minutes", -1.0),
    ],
)
def test_the_values_that_used_to_pass(key, value):
    with pytest.raises(ConfigError, match=re.escape(key)):
        config_from_dict(_set({}, key, value))
