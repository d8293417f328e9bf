"""Valid ranges of the config's numeric keys, declared on the fields themselves.

Every int or float field of a config section carries its range in the field's metadata::

    eval_steps: int = field(default=10, metadata=at_least(1))
    val_fraction: float = field(default=0.01, metadata=between(0, 1, high_open=True))

:func:`check_ranges` refuses a value outside it, naming the dotted key; ``None`` (where the
type allows it) means "not set" and is not checked. Rules between keys stay in the sections'
``validate``; enumerated keys are ``Literal`` types, refused by the loader.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from moetrain.config.checks import require

RANGE = "range"


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (either end open or absent); ``note`` says what an end means."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.high is None:
            text = f"must be {'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"must be in {left}{_num(self.low)}, {_num(self.high)}{right}"
        return f"{text} ({self.note})" if self.note else text


def _num(x: float | None) -> str:
    return "-inf" if x is None else f"{x:g}"


def at_least(low: float, note: str = "") -> dict[str, Range]:
    """Field metadata: ``value >= low``."""
    return {RANGE: Range(low, note=note)}


def above(low: float, note: str = "") -> dict[str, Range]:
    """Field metadata: ``value > low``."""
    return {RANGE: Range(low, low_open=True, note=note)}


def between(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False, note: str = ""
) -> dict[str, Range]:
    """Field metadata: ``low <= value <= high`` (``*_open``: that end excluded)."""
    return {RANGE: Range(low, high, low_open, high_open, note)}


# Field metadata of a positive integer key.
POSITIVE_INT = above(0, "a positive integer")
# Field metadata: the field defines the function the model computes (a checkpoint.init_from
# source decides it, a config may not contradict it).
FUNCTION = {"function": True}


def check_ranges(section: Any, prefix: str) -> None:
    """Refuse a field of ``section`` outside its declared range (ConfigError naming
    ``<prefix>.<field>``, the range and the value)."""
    for f in dataclasses.fields(section):
        declared = f.metadata.get(RANGE)
        value = getattr(section, f.name)
        if declared is None or value is None or isinstance(value, bool):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        finite = not isinstance(value, float) or math.isfinite(value)
        require(finite, key, f"must be a finite number; got {value}")
        require(declared.contains(value), key, f"{declared.describe()}; got {value}")


def check_tree_ranges(section: Any, prefix: str = "") -> None:
    """:func:`check_ranges` on ``section`` and every section below it. Lists of sections
    (``data.sources``) are their owner's to check: its errors name the entry."""
    check_ranges(section, prefix)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_tree_ranges(value, f"{prefix}.{f.name}" if prefix else f.name)
