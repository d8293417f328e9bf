"""Spawn real ranks on CPU with gloo: ``run_distributed(fn, world_size, *args)``.

``fn(rank, world_size, *args)`` runs in a fresh process per rank with the default process
group initialised (gloo, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set, one thread). The group's
store is a TCPStore server the parent binds on port 0 (the kernel picks a free port and the
server holds it from then on) and keeps until every rank has ended; the ranks join it as
clients, so nothing chooses a port that another process could take first. Returns the list of the ranks' return values (picklable), in rank order. An exception
on any rank fails the call with that rank's traceback; the process group is destroyed in
``finally``. ``fn`` must be importable by module name (a module-level function of a module
under ``tests``, e.g. ``tests.distributed.parity_jobs``): spawned ranks unpickle it.

In the test session (tests/conftest.py sets :data:`PRELOADED`) the ranks are forked from a
server process that has already imported what every rank needs (:mod:`tests.helpers.rank_preload`:
torch, DeepSpeed, moetrain's trainer, DeepSpeed's shm comm op), started once, so a rank does not
spend seconds importing them again. Elsewhere (benchmarks/) each rank is spawned fresh, so that
what they measure is a fresh process's.

``run_distributed_concurrently([(fn, world_size, *args), ...])`` starts several such jobs at once
(each its own process group and port) and returns their results in the same order: on 2 cores,
a job's single-process or waiting phases then overlap another job's work.
"""

from __future__ import annotations

import atexit
import io
import os
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

PRELOADED = False
"""Fork the ranks from a server with :mod:`tests.helpers.rank_preload` imported (else spawn)."""
_PRELOAD = "tests.helpers.rank_preload"
_context: Any = None


def _rank_context() -> Any:
    """multiprocessing's spawn context, or with :data:`PRELOADED` its forkserver context, the
    server started (once, one thread per process) with :mod:`tests.helpers.rank_preload`
    imported."""
    global _context
    if not PRELOADED:
        return mp.get_context("spawn")
    if _context is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([_PRELOAD])
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server imports torch: as the ranks run it
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        # at exit, end the server and wait for it (it waits for its ranks): no process is left,
        # and the CPU time of the ranks counts in the test process's children's
        atexit.register(forkserver._forkserver._stop)
        _context = ctx
    return _context


def _worker(
    rank: int, world_size: int, port: int, queue: Any, fn: Callable[..., Any], args: tuple
) -> None:
    """Rank ``rank``: join the parent's store on ``port``, start the group, run ``fn``."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # tensors travel as bytes, not as shared-memory handles
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report every failure, including SystemExit, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks."""
    import torch.distributed as dist

    ctx = _rank_context()
    queue = ctx.SimpleQueue()
    # bound on port 0 here and kept until the ranks are gone: no port race
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, queue, fn, args), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, ok, payload = queue.get()
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
            continue
        if time.monotonic() > deadline:
            errors.append(f"timed out after {timeout:.0f}s")
            break
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and queue.empty():
            errors.append(f"rank process exited with code {dead[0].exitcode}")
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if errors else 30)
        if p.is_alive():
            p.kill()
            p.join()
    del store  # (the server closes once the ranks are gone)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def run_distributed_concurrently(
    jobs: Sequence[tuple[Any, ...]], timeout: float = 300.0
) -> list[list[Any]]:
    """:func:`run_distributed` for every ``(fn, world_size, *args)`` in ``jobs``, all started at
    once; -> each job's per-rank results, in the order of ``jobs``. Any failure fails the call
    (after every job has ended)."""
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [
            pool.submit(run_distributed, fn, world, *args, timeout=timeout)
            for fn, world, *args in jobs
        ]
        return [f.result() for f in futures]
