"""Fault injection repeated until a rare hang would show (minutes; run with ``-m long``).

- ``kill -9`` of a worker under ``torchrun --max-restarts 1``, :data:`ROUNDS` times, the killed
  rank and the step alternating: every job must exit 0 with the uninterrupted run's losses,
  bit for bit. A hang on the restarted round fails the round by its timeout.
- The same through two loopback "nodes": one node's worker killed, its agent restarts it.
- A kill at every point of a save (:mod:`moetrain.faults`), one restart round each: the job
  resumes from the previous complete checkpoint each time and ends with the reference's losses.

The single-kill versions are tests/e2e/test_resume.py's: the kill inside a save (a worker killed
and restarted in place) in the default suite, the worker killed mid-run with ``-m long``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.restarts import kill_during_save, kill_worker_in_place, overrides, run, torchrun
from tests.helpers.launch import logged_losses, losses

pytestmark = [pytest.mark.slow, pytest.mark.long]

ROUNDS = 10
ALL_SAVE_FAULTS = [
    "save.before_shards:1:10",
    "save.between_shards:0:10",
    "save.after_shards:1:10",
    "save.commit:0:10",
]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("loop-ref") / "run"
    r = run(torchrun(run_dir, overrides(tiny_data)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir


@pytest.mark.timeout(ROUNDS * 300)
def test_in_place_restart_loop(tiny_data, reference, tmp_path):
    outcomes = []
    for i in range(ROUNDS):
        work = tmp_path / f"round{i}"
        work.mkdir()
        rank, after = i % 2, 3 + i % 5
        run_dir, killed_at, code, out = kill_worker_in_place(tiny_data, work, after, rank)
        ok = code == 0 and losses(run_dir) == losses(reference)
        outcomes.append((i, rank, killed_at, code, ok))
        print(f"round {i}: kill -9 rank {rank} after step {killed_at}: exit {code}, match {ok}")
        if not ok:
            print(out[-4000:])
    good = sum(o[-1] for o in outcomes)
    print(f"{good}/{ROUNDS} in-place restarts exited 0 with bit-identical losses")
    assert good == ROUNDS, outcomes


def test_kill_at_every_point_of_a_save(tiny_data, reference, tmp_path):
    run_dir, r = kill_during_save(tiny_data, reference, tmp_path, ALL_SAVE_FAULTS)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert len(list((tmp_path / "fired").iterdir())) == len(ALL_SAVE_FAULTS)
    ckpts = run_dir / "checkpoints"
    assert out.count(f"resumed from {ckpts / 'step_00000008'}") == len(ALL_SAVE_FAULTS) + 1
    # before_shards leaves an empty (or no) directory; every later point a partial one
    assert out.count(f"removed incomplete checkpoint {ckpts / 'step_00000010'}") >= 3
    ref = losses(reference)
    assert losses(run_dir) == {s: ref[s] for s in (9, 10)}


def test_two_node_worker_killed_restarts_in_place(tiny_data, tmp_path):
    """Two loopback "nodes" (launch/multinode-torchrun.sh, 2 x 2 gloo ranks, MAX_RESTARTS=1):
    one worker of node 1 is killed (kill -9) after the first checkpoint; node 1's agent restarts
    its workers, node 0's agent follows into the new rendezvous round, and the job resumes from
    the newest complete checkpoint and exits 0 on both nodes. Steps trained before the kill
    and again after the resume log the same losses, bit for bit (same layout)."""
    from moetrain.checkpoint.catalog import latest_complete
    from tests.e2e.test_multinode import RUN, descendants, start_two_nodes

    steps, every = 12, 4
    ov = [*tiny_data, *RUN, f"train.max_steps={steps}", f"checkpoint.save_every_steps={every}"]
    run_dir = tmp_path / "run"
    nodes = start_two_nodes(tmp_path / "nodes", run_dir, ov, MAX_RESTARTS="1")
    try:
        end = time.monotonic() + 300
        while not (
            latest_complete(run_dir / "checkpoints") is not None
            and max((s for s, _ in logged_losses(run_dir)), default=0) >= every + 2
        ):
            assert time.monotonic() < end, nodes[0].output()[-3000:]
            assert all(n.proc.poll() is None for n in nodes), nodes[0].output()[-3000:]
            time.sleep(0.05)
        workers = [p for p in descendants(nodes[1].proc.pid) if _is_worker(p)]
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        codes = [n.wait(timeout=300) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    outs = nodes[0].output() + nodes[1].output()
    assert codes == [0, 0], f"exit codes {codes}\n{outs[-4000:]}"
    assert "resumed from" in outs, outs[-3000:]
    log = logged_losses(run_dir)
    assert sorted(losses(run_dir)) == list(range(1, steps + 1))
    cut = next(i for i in range(1, len(log)) if log[i][0] <= log[i - 1][0])
    first, again = dict(log[:cut]), log[cut:]
    overlap = [(s, loss) for s, loss in again if s in first]
    assert overlap, "no step was trained both before the kill and after the resume"
    assert all(first[s] == loss for s, loss in overlap), overlap


def _is_worker(pid: int) -> bool:
    """A worker torchrun started (it alone has LOCAL_RANK in its environment)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(e.startswith(b"LOCAL_RANK=") for e in env)
