"""The console channel of the monitor modules (stderr, flushed, prefixed)."""

from __future__ import annotations

import sys
from collections.abc import Callable

Printer = Callable[[str], None]


def console(message: str) -> None:
    """Print one monitoring message to stderr as ``moetrain: <message>``."""
    print(f"moetrain: {message}", file=sys.stderr, flush=True)
