"""A key-value store that no earlier launch of the same job has written to.

Under torchrun's c10d rendezvous (also ``--standalone`` and ``accelerate launch``) the workers'
store is the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``), and the agent keeps that
one server for every restart round. The keys a killed round wrote (gloo's listening addresses,
NCCL's unique id, group bookkeeping) are still there when ``--max-restarts`` starts the next
round, under the same names: a new worker can read a dead peer's address and fail with
"Connection refused" in ``connectFullMesh``, or wait on a group that will never form
(PyTorch issue 135712). ``TORCHELASTIC_RESTART_COUNT`` cannot tell rounds apart, because each
agent counts only its own restarts.

:func:`fresh_namespace` agrees on a new key prefix for this launch instead: rank 0 names the
namespace after a random token, every other rank registers under a ticket from a counter
(``add`` never returns an old value) and its own random token, rank 0 answers each registration
at a key only that token names, and each rank confirms under the new namespace. A registration
left by a dead process gets an answer nobody reads; nothing stale is ever read as current.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta

import torch.distributed as dist

from moetrain.rank_env import read_rank_env

_ROOT = "moetrain/launch"
_POLL_S = 0.02


def agent_store_in_use(env: dict[str, str] | None = None) -> bool:
    """True when the launcher tells workers to use its long-lived agent store."""
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def agent_store(timeout: timedelta) -> dist.Store:
    """A client of the agent's TCPStore (MASTER_ADDR:MASTER_PORT), as torch's env:// would
    open it."""
    return dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=read_rank_env().world_size,
        is_master=False,
        timeout=timeout,
    )


def fresh_namespace(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The key prefix of this launch, the same on every rank (see the module docstring).

    Raises TimeoutError naming the ranks that did not register within ``timeout``.
    """
    token = secrets.token_hex(8)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0:
        ticket = store.add(f"{_ROOT}/tickets", 1)
        store.set(f"{_ROOT}/ticket/{ticket}", f"{rank} {token}")
        try:
            store.wait([f"{_ROOT}/answer/{token}"], timeout)
        except dist.DistError as e:  # DistStoreError: a timeout of the store
            raise TimeoutError(
                f"rank {rank}: rank 0 did not answer within {timeout.total_seconds() / 60:g} "
                f"minutes (parallel.timeout_minutes): {e}"
            ) from e
        namespace = store.get(f"{_ROOT}/answer/{token}").decode()
        store.set(f"{namespace}/joined/{rank}", "1")
        return namespace

    namespace = f"{_ROOT}/{token}"
    if world_size == 1:
        return namespace
    answered = 0  # tickets up to here are answered or were never written (writer died)
    pending: set[int] = set()
    joined = [f"{namespace}/joined/{r}" for r in range(1, world_size)]
    while True:
        newest = store.add(f"{_ROOT}/tickets", 0)
        pending.update(range(answered + 1, newest + 1))
        answered = max(answered, newest)
        for ticket in sorted(pending):
            key = f"{_ROOT}/ticket/{ticket}"
            if store.check([key]):
                _, their_token = store.get(key).decode().split()
                store.set(f"{_ROOT}/answer/{their_token}", namespace)
                pending.discard(ticket)
        if store.check(joined):
            return namespace
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(joined, start=1) if not store.check([key])]
            raise TimeoutError(
                f"rank 0: ranks {missing} did not join this launch within "
                f"{timeout.total_seconds() / 60:g} minutes (parallel.timeout_minutes)"
            )
        time.sleep(_POLL_S)
