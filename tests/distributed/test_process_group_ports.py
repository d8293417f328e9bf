"""The test helpers start process groups and launchers without a port race (a busy machine's
other processes take ports all the time)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.helpers import ports
from tests.helpers.distributed import run_distributed, run_distributed_concurrently

pytestmark = pytest.mark.slow


def rank_sum(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def test_process_groups_start_while_another_process_takes_every_port_picked(monkeypatch) -> None:
    """Whatever port a helper might pick and release is taken by another process at once (the
    race of a busy machine): three groups still start at the same time, since none of them
    depends on a port chosen in advance."""
    taken: list[socket.socket] = []
    picked = ports.free_port

    def rival_takes_it() -> int:
        port = picked()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        taken.append(s)
        return port

    import tests.helpers.distributed as helper

    monkeypatch.setattr(helper, "free_port", rival_takes_it, raising=False)
    monkeypatch.setattr(ports, "free_port", rival_takes_it)
    try:
        done = run_distributed_concurrently([(rank_sum, 2), (rank_sum, 2), (rank_sum, 3)])
        assert done == [[3, 3], [3, 3], [6, 6, 6]]
        assert run_distributed(rank_sum, 2) == [3, 3]
    finally:
        for s in taken:
            s.close()


def test_a_launcher_port_is_outside_the_ephemeral_range_and_locked() -> None:
    low, _ = ports._ephemeral_range()
    port = ports.free_port()
    assert port < low and port != ports.free_port()
    probe = (
        "import fcntl, sys\n"
        f"f = open({str(ports.LOCK_DIR / f'{port}.lock')!r}, 'w')\n"
        "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
        "    sys.exit(3)\n"
    )
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 3
