"""A local TCP port for a launcher's rendezvous that no other process takes before it binds.

A port found free and released can be taken by anything before the launcher binds it: above
all by the many ports the kernel hands out for ``bind(0)`` and outgoing connections (process
groups, stores, gloo's pairs), which come from its ephemeral range. :func:`free_port` picks
below that range, where nothing is handed out by chance, and holds an exclusive lock on the
port (a file lock, shared by every test process on the machine) for this process's life, so
that no other caller of this helper picks it too. Process groups in one test need no port at
all: :mod:`tests.helpers.distributed` hands them a store the parent bound on port 0.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import IO

LOCK_DIR = Path(tempfile.gettempdir()) / "moetrain-test-ports"
_HELD: list[IO[str]] = []  # this process's port locks, released when it exits


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 below the kernel's ephemeral range that nothing listens on, locked
    for this process (the caller binds it, or hands it to a launcher that does)."""
    low, _ = _ephemeral_range()
    first = 20000 if low > 21000 else 1024
    LOCK_DIR.mkdir(exist_ok=True)
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(500):
        port = rng.randrange(first, low)
        lock = open(LOCK_DIR / f"{port}.lock", "w")  # noqa: SIM115 (held past this call)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        if _bindable(port):
            _HELD.append(lock)
            return port
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    raise RuntimeError(f"no free port between {first} and {low} after 500 tries")
