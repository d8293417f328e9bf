"""The run's one console channel: stdout, flushed, every line prefixed ``moetrain: ``.

Training progress, checkpoint and evaluation messages and warnings (``warning: ...``) all go
through :func:`console`; components take a ``printer`` argument defaulting to it, so tests can
collect the messages.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

Printer = Callable[[str], None]


def console(message: str) -> None:
    """Print one message as ``moetrain: <message>`` to stdout."""
    print(f"moetrain: {message}", file=sys.stdout, flush=True)
