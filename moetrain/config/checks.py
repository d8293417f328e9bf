"""The config's error type and the checks every section uses."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


def require(cond: bool, key: str, msg: str) -> None:
    """Raise ``ConfigError("<key>: <msg>")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")
