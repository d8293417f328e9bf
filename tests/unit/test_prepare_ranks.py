"""The pieces of a distributed prepare in one process: ranks from the launcher's environment,
size-balanced chunks, heartbeats, and a rank that fails on bad input while another waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moetrain.config import load_config
from moetrain.data import DataError
from moetrain.data.chunks import (
    _run,
    _Worker,
    chunk_bytes,
    chunk_owners,
    chunk_targets,
    plan_chunks,
)
from moetrain.data.prepare import prepare
from moetrain.data.ranks import Heartbeat, Ranks, RankStopped, Watch, default_num_proc
from tests.unit.test_data_prepare import write_jsonl


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, Ranks(0, 1, 1)),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, Ranks(3, 8, 4)),
        ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_SIZE": "2"}, Ranks(2, 4, 2)),  # deepspeed
        ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6"}, Ranks(5, 6, 1)),
        # a launcher's RANK wins over the SLURM task it runs in
        ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, Ranks(1, 2, 1)),
        # the batch script of a job (no job step): one process
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, Ranks(0, 1, 1)),
    ],
)  # fmt: skip
def test_ranks_from_the_environment(env, want):
    assert Ranks.from_env(env) == want


def test_bad_rank_environment():
    with pytest.raises(DataError, match=r"RANK / WORLD_SIZE: rank 4 is not in \[0, 4\)"):
        Ranks.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(DataError, match="WORLD_SIZE='two' is not an integer"):
        Ranks.from_env({"RANK": "0", "WORLD_SIZE": "two"})


def test_default_num_proc_shares_the_cores():
    assert default_num_proc(3, Ranks(0, 2, 2)) == 3
    one = default_num_proc(0, Ranks())
    assert one >= 1 and default_num_proc(0, Ranks(0, 64, 64)) == max(1, one // 64)


def test_chunk_targets_shrink_towards_the_end():
    for total, max_bytes, workers in [
        (14_700_000, 16 << 20, 2),
        (1 << 40, 16 << 20, 32),
        (10, 3, 4),
    ]:
        sizes = chunk_targets(total, max_bytes, workers)
        assert sum(sizes) == total and all(0 < s <= max_bytes for s in sizes)
        assert sizes == sorted(sizes, reverse=True)
    sizes = chunk_targets(14_700_000, 16 << 20, 2)
    # each takes a quarter of what is left, down to 1/32 of a worker's share: few chunks, and
    # the last ones small (they set how long one worker runs after the other has finished)
    assert sizes[0] == 14_700_000 // 4 and min(sizes[:-1]) == 14_700_000 // 64
    assert 10 <= len(sizes) <= 20
    assert chunk_targets(1 << 40, 16 << 20, 32)[0] == 16 << 20  # the cap
    assert chunk_targets(0, 16, 2) == []


def test_chunks_are_contiguous_and_follow_the_targets():
    rng = np.random.default_rng(0)
    sizes = rng.pareto(1.2, 5000).astype(np.int64) * 100 + rng.integers(0, 50, 5000)
    sizes[::97] = 0  # empty documents still belong to a chunk
    for max_bytes, workers in [(1 << 30, 4), (int(sizes.sum()) // 40, 2)]:
        chunks = plan_chunks(sizes, max_bytes, workers)
        assert chunks[0][0] == 0 and chunks[-1][1] == len(sizes)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(chunks, chunks[1:], strict=False))
        per = np.array([sizes[lo:hi].sum() + (hi - lo) for lo, hi in chunks])
        assert chunk_bytes(sizes, chunks) == per.tolist()
        # every chunk but the last ends with the document that reaches a target
        targets = np.cumsum(chunk_targets(int(per.sum()), max_bytes, workers))
        for end, (_, hi) in zip(np.cumsum(per)[:-1], chunks, strict=False):
            last_doc = sizes[hi - 1] + 1
            assert targets[np.searchsorted(targets, end - last_doc, side="right")] <= end
        assert per.max() <= max(max_bytes, 0) + sizes.max() + 1
        # largest chunks first, each to the least-loaded rank: every rank's share is within a
        # chunk of the others', and at least as even as dealing the chunks in turn
        for world in (1, 2, 3, 5, 40):
            owners = chunk_owners(per.tolist(), world)
            assert owners == chunk_owners(per.tolist(), world)
            shares = [per[np.array(owners) == r].sum() for r in range(world)]
            assert max(shares) - min(shares) <= per.max()
            in_turn = [per[r::world].sum() for r in range(world)]
            assert max(shares) - min(shares) <= max(in_turn) - min(in_turn)
    assert plan_chunks(np.array([5, 0, 7]), 1, 10) == [(0, 1), (1, 2), (2, 3)]
    assert plan_chunks(np.zeros(0, np.int64), 16, 4) == []


def _slow_task(task: tuple[float, bool]) -> None:
    seconds, fail = task
    time.sleep(seconds)
    if fail:
        raise DataError(f"task of {seconds}s failed")


def test_the_pool_keeps_every_worker_busy_and_reports_a_workers_error():
    worker = _Worker(Path("."), "", np.dtype(np.uint16), 0.0)
    done: list[float] = []
    # one long task first: with tasks sent in order of submission the other worker would
    # idle behind it once the window of 2 x 2 tasks filled
    tasks = [(1.2, False)] + [(0.05, False)] * 24  # in order: done after ~1.2 + 21 x 0.05 / 2 s
    t0 = time.perf_counter()
    _run(_slow_task, iter(tasks), 2, worker, lambda: done.append(time.perf_counter() - t0))
    assert len(done) == len(tasks) and max(done) < 1.45
    # the first task goes to the forked worker, the second to this process: either may fail,
    # and a failure stops the taking of new tasks
    for failing in (0, 1):
        tasks = [(0.1, True) if i == failing else (0.3, False) for i in range(2)]
        tasks += [(5.0, False)] * 4  # never started: the tasks in progress finish, no more
        t0 = time.perf_counter()
        with pytest.raises(DataError, match="task of 0.1s failed"):
            _run(_slow_task, iter(tasks), 2, worker, list)
        assert time.perf_counter() - t0 < 4


def test_a_chunk_made_large_by_one_document_is_dealt_first():
    costs = [10, 10, 10, 40, 10, 10, 10, 10]
    # rank 0 takes the large chunk, rank 1 the next four; then each goes to the lighter rank
    assert chunk_owners(costs, 2) == [1, 1, 1, 0, 1, 0, 1, 0]
    assert chunk_owners([], 3) == [] and chunk_owners([5, 5], 1) == [0, 0]


def test_watch_waits_for_a_live_rank_and_gives_up_on_a_dead_one(tmp_path):
    ready = threading.Event()
    with Heartbeat(tmp_path, 1):
        threading.Timer(0.3, ready.set).start()
        Watch(tmp_path, timeout_s=5).until(ready.is_set, [1], "a file")
    with pytest.raises(RankStopped, match="rank 1 stopped .*while this rank waited for a file"):
        Watch(tmp_path, timeout_s=0.3).until(lambda: False, [1], "a file")
    with pytest.raises(RankStopped, match="rank 2 never started"):
        Watch(tmp_path, timeout_s=0.3).until(lambda: False, [2], "a file")


def test_a_rank_waiting_on_rank_0_that_fails_on_bad_input(tmp_path):
    """Rank 0 finds the corpus empty and removes its build directory; rank 1, waiting for the
    plan, stops at once with an error that points at rank 0 (not after the timeout)."""
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    cfg = load_config(
        None,
        [
            "model.vocab_size=320",
            f"data.source={blank}",
            f"data.output_dir={tmp_path / 'out'}",
        ],
    )
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            prepare(cfg, Ranks(r, 2))
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            errors[r] = e

    waiting = threading.Thread(target=rank, args=(1,))
    waiting.start()
    deadline = time.monotonic() + 60  # until rank 1 waits for the plan (its heartbeat is there)
    while not list(tmp_path.glob(".out.*/heartbeat/rank-1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    rank(0)
    waiting.join(timeout=60)
    assert not waiting.is_alive() and time.monotonic() - t0 < 30
    assert isinstance(errors[0], DataError) and "empty corpus" in str(errors[0])
    assert "rank 0 stopped and removed" in str(errors[1]), errors[1]
    assert not list(Path(tmp_path).glob(".out.*"))
