"""``data.sources``: the sources of a data mixture, each with a weight and its own settings.

``data.source`` is the short form of a one-source corpus; ``data.sources`` lists several::

    data:
      sources:
        - {source: web/*.jsonl, weight: 0.6}
        - {source: code.parquet, weight: 0.3, text_field: content, name: code}
        - {source: hf:org/math, weight: 0.1, split: train}

Weights are relative (they need not sum to 1). A setting left out of an entry (``text_field``,
``source_format``, ``split``, ``max_docs``) takes the value of ``data.<setting>``. ``name``
defaults to a name made from the source (the file or dataset name); names must be unique, as
they name the source in metrics (``data/tokens/<name>``, ``val/loss/<name>``) and on disk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Literal

from moetrain.config.ranges import above, at_least, check_ranges

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SourceFormat = Literal["text", "json", "parquet", "csv"]


@dataclass
class SourceConfig:
    """One source of a mixture (``data.sources[i]``)."""

    source: str = ""  # anything data.source accepts: builtin:NAME, a path or glob, hf:NAME[:CONFIG]
    weight: float = field(default=1.0, metadata=above(0))  # relative share of the samples
    name: str | None = None  # metric and directory name; default from the source
    text_field: str | None = None  # default data.text_field
    source_format: SourceFormat | None = None  # default data.source_format
    split: str | None = None  # default data.split (Hub datasets)
    max_docs: int | None = field(default=None, metadata=at_least(1))  # default data.max_docs


def default_source_name(source: str) -> str:
    """A name made from a source spec: ``builtin:stdlib`` -> ``stdlib``, ``hf:org/ds:cfg`` ->
    ``ds-cfg``, ``corpus/web-*.jsonl.gz`` -> ``web``, ``data/code/`` -> ``code``."""
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        base = name.rstrip("/").rsplit("/", 1)[-1] + (f"-{config}" if config else "")
    elif ":" in source and not PurePath(source).is_absolute() and "/" not in source.split(":")[0]:
        base = source.split(":", 1)[1]
    else:
        path = PurePath(source.rstrip("/"))
        parts = [p for p in path.parts if not any(c in p for c in "*?[")] or ["source"]
        base = path.name if path.name == parts[-1] else parts[-1]
        base = base.split(".")[0] if not base.startswith(".") else base
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.") or "source"
    return base if base[0].isalnum() else f"s{base}"


def validate_sources(sources: list[SourceConfig], single_source: str, default_source: str) -> None:
    """Check every entry of ``data.sources``; errors name ``data.sources[i].<key>`` and the source.

    ``single_source`` is ``data.source``: with a mixture it must stay at its default
    (``default_source``), since only one of the two forms can describe the corpus.
    """
    from moetrain.config.checks import ConfigError

    if not sources:
        return
    if single_source != default_source:
        raise ConfigError(
            f"data.source: set to {single_source!r} together with data.sources; use one form "
            "(data.source for one source, data.sources for a mixture)"
        )
    names: dict[str, int] = {}
    for i, s in enumerate(sources):
        key = f"data.sources[{i}]"
        if not isinstance(s.source, str) or not s.source.strip():
            raise ConfigError(f"{key}.source: missing; every entry needs a source")
        label = f"(source {s.source!r})"
        try:
            check_ranges(s, key)
        except ConfigError as e:
            raise ConfigError(f"{e} {label}") from None
        if s.name is not None and not _NAME.match(s.name):
            raise ConfigError(
                f"{key}.name: {s.name!r} {label}: use letters, digits, '_', '-' and '.', "
                "starting with a letter or digit"
            )
        name = s.name or default_source_name(s.source)
        if name in names:
            raise ConfigError(
                f"{key}.name: {name!r} {label} is also the name of data.sources[{names[name]}]; "
                "names must be unique (set name: on one of them)"
            )
        names[name] = i
