"""Loading a config: YAML file, dotted command-line overrides, type checks against the dataclasses.

Unknown keys and wrong types are errors that name the dotted key; values are then checked by
``Config.validate``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from moetrain.config.checks import ConfigError
from moetrain.config.sections import Config


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):  # a section inside a list, e.g. data.sources[1]
        try:
            return _build(tp, value, f"{key}.")
        except ConfigError as e:  # name the item by what it describes, too
            label = value.get("name") or value.get("source") if isinstance(value, dict) else None
            raise ConfigError(f"{e} (in {label!r})" if isinstance(label, str) else str(e)) from None
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
    elif origin is list:
        if isinstance(value, list):
            (item_tp,) = typing.get_args(tp)
            return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {tp!r} at {key}")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            allowed = ", ".join(fields)
            raise ConfigError(f"{dotted}: unknown key; allowed keys here: {allowed}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, dotted + ".")
        else:
            kwargs[key] = _coerce(value, tp, dotted)
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    """Parse an override value with YAML rules (``16`` -> int, ``true`` -> bool, ``null``)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]$")


def _child(node: dict[str, Any], part: str, where: str) -> Any:
    """The section ``part`` of ``node`` (created when missing); ``name[i]`` is item i of a list."""
    m = _INDEXED.match(part)
    if m is None:
        return node.setdefault(part, {})
    items = node.get(m.group(1))
    i = int(m.group(2))
    if not isinstance(items, list) or i >= len(items):
        have = len(items) if isinstance(items, list) else 0
        raise ConfigError(f"{where}: no such item ({m.group(1)} has {have})")
    return items[i]


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (in place); returns it.

    ``data.sources[1].weight=0.2`` sets a key of one item of a list of sections."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. moe.num_experts=16")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key component")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = _child(node, part, ".".join(parts[: i + 1]))
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(text)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate."""
    return config_from_dict(read_config_data(path, overrides))


def read_config_data(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """The raw nested dict of a YAML config with dotted overrides applied (nothing checked
    yet): what the file and the command line set, and nothing else."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
        data = loaded
    apply_overrides(data, list(overrides or []))
    return data


def config_from_dict(data: dict[str, Any], validate: bool = True) -> Config:
    """Build a Config from a nested dict (``Config.to_dict()`` output, e.g. from a checkpoint,
    or :func:`read_config_data`'s); keys and types are always checked, values unless
    ``validate`` is false (then the caller validates)."""
    cfg = _build(Config, data, "")
    if validate:
        cfg.validate()
    return cfg
