"""Two "nodes" on one machine, through the real launchers and the real CLI.

Each node is its own ``launch/multinode-torchrun.sh`` (a ``torchrun --nnodes 2 --nproc-per-node
2`` agent) meeting the other in a c10d rendezvous on 127.0.0.1, so the job has 4 gloo ranks on
CPU running ``python -m moetrain train``. The reference is the single-node 4-process run started
by ``launch/train.sh``. Checked:

- the two-node job trains and its per-step losses equal the single-node run's (1e-6);
- the data shards of the 4 global ranks are disjoint and together form the global batch (the
  loaders the ranks build, identified by sample contents), and observably so: one process that
  reads the whole global batch itself gives the same losses as the 4 ranks;
- killing one node's agent and workers mid-run, then starting the job again on both nodes,
  resumes from the last complete checkpoint (MAX_RESTARTS=0: the job is restarted by hand, as a
  scheduler would; one worker killed and restarted in place by its agent under MAX_RESTARTS=1
  is tests/e2e/test_fault_loops.py's two-node test). With ``-m long`` (minutes).

Tiny shapes, one thread per process, a generated 600-document corpus with a 512-piece tokenizer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import CONFIG, PY, ROOT, env_for, logged_losses, losses
from tests.helpers.ports import free_port

STEPS = 6
MBS = 2  # per rank; 4 ranks -> 8 sequences per step
RUN = [
    "parallel.ep_size=2",
    "parallel.zero_stage=2",
    f"train.max_steps={STEPS}",
    f"train.micro_batch_size={MBS}",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_overrides(tiny_data) -> list[str]:
    """The session's prepared corpus (tokenizer + shards) and this module's run settings."""
    return [*tiny_data, *RUN]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Job:
    """A launcher command in the background in a session of its own, output to a log file."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path):
        self.log_path = log
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.flush()

    def kill(self) -> None:
        """Kill the launcher and its workers at once, as a node failure would. torchrun starts
        each worker in a session of its own, so the whole process tree is collected first."""
        if self.proc.poll() is not None:
            return
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")


class Node(Job):
    """One simulated node: a launch/multinode-torchrun.sh agent in its own process group."""

    def __init__(self, rank: int, port: int, run_dir: Path, overrides: list[str], log: Path, **env):
        self.port = port
        cmd = ["bash", "launch/multinode-torchrun.sh", CONFIG, *overrides, f"run_dir={run_dir}"]
        node_env = env_for(
            NNODES="2",
            NPROC="2",
            NODE_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RDZV_ID="mn-test",
            RDZV_TIMEOUT="120",
            LOCAL_ADDR="127.0.0.1",
            # NPROC is given: the GPU count only skips a torch import in launch/common.sh
            # (the detection runs in tests/e2e/test_launchers.py)
            GPUS="0",
            **env,
        )
        super().__init__(cmd, node_env, log)


def wait_for_listener(port: int, timeout: float = 60) -> None:
    """Until the rendezvous store of the first agent accepts connections on 127.0.0.1:port."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"no rendezvous store on port {port} after {timeout}s")


def start_two_nodes(tmp: Path, run_dir: Path, overrides: list[str], **env) -> list[Node]:
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # Node 0 first, so that its agent hosts the c10d store (node 1 can then be killed safely).
    n0 = Node(0, port, run_dir, overrides, tmp / "node0.log", **env)
    wait_for_listener(port)
    n1 = Node(1, port, run_dir, overrides, tmp / "node1.log", **env)
    return [n0, n1]


@pytest.fixture(scope="module")
def first_runs(data_overrides, tmp_path_factory) -> dict:
    """The single-node reference (launch/train.sh, 4 processes) and the one process that reads
    the whole global batch at the same time (that process alone would leave a core idle), then
    the two-node job. -> name -> (exit codes, output, run_dir)."""
    work = tmp_path_factory.mktemp("mn-runs")
    single_dir, two_dir, one_dir = work / "single", work / "two" / "run", work / "one"
    env = env_for(NPROC="4", LAUNCHER="auto", GPUS="0", MASTER_PORT=str(free_port()))
    cmd = ["bash", "launch/train.sh", CONFIG, *data_overrides, f"run_dir={single_dir}"]
    jobs = {"single": [Job(cmd, env, work / "single.log")]}
    ov = [*data_overrides, f"train.micro_batch_size={MBS * 4}", "parallel.ep_size=1"]
    cmd = [PY, "-m", "moetrain", "train", CONFIG, *ov, f"run_dir={one_dir}"]
    jobs["one"] = [Job(cmd, env_for(), work / "one.log")]
    try:
        codes = {name: [j.wait(timeout=300) for j in js] for name, js in jobs.items()}
        jobs["two"] = start_two_nodes(work / "two", two_dir, data_overrides, MAX_RESTARTS="0")
        codes["two"] = [j.wait(timeout=300) for j in jobs["two"]]
    finally:
        for js in jobs.values():
            for j in js:
                j.kill()
    dirs = {"single": single_dir, "two": two_dir, "one": one_dir}
    return {
        name: (codes[name], "".join(j.output() for j in js), dirs[name])
        for name, js in jobs.items()
    }


def _finished(run: tuple) -> tuple[str, Path]:
    codes, out, run_dir = run
    assert codes == [0] * len(codes), f"exit codes {codes}\n{out[-6000:]}"
    return out, run_dir


@pytest.fixture(scope="module")
def single_node(first_runs) -> dict[int, float]:
    """Reference: one node, 4 processes, started by launch/train.sh (torchrun, gloo)."""
    out, run_dir = _finished(first_runs["single"])
    assert "launcher=torchrun" in out and "world 4" in out, out[-3000:]
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    return got


def test_two_nodes_train_and_match_single_node(first_runs, single_node):
    both, run_dir = _finished(first_runs["two"])
    assert "world 4" in both and "gloo" in both, both[-3000:]
    multi = losses(run_dir)
    assert sorted(multi) == sorted(single_node)
    for step, loss in single_node.items():
        assert abs(multi[step] - loss) <= 1e-6, (step, multi[step], loss)
    # It actually trained.
    assert multi[STEPS] < multi[1]


def test_rank_shards_are_disjoint_and_form_the_global_batch(data_overrides):
    """The loaders that global ranks 0..3 build (as the trainer builds them: dp_rank = global
    rank, dp_world = 4, the run's seed) read disjoint samples that together are the global batch
    one process reading 4 x micro_batch_size would see."""
    from moetrain.config import load_config
    from moetrain.data.splits import build_loader

    cfg = load_config(CONFIG, data_overrides)
    world = 4
    ranks = [build_loader(cfg.data, "train", MBS, rank, world, cfg.seed) for rank in range(world)]
    whole = build_loader(cfg.data, "train", MBS * world, 0, 1, cfg.seed)
    # Identify each row by its contents: sample id from the token stream itself.
    by_inputs = {whole.sample_tokens(s)[:-1].tobytes(): s for s in range(whole.num_samples)}
    seen: list[set[int]] = [set() for _ in range(world)]
    for _ in range(STEPS):
        parts = [next(loader)["input_ids"] for loader in ranks]
        ref = next(whole)["input_ids"]
        for rank, part in enumerate(parts):
            for row in part:
                seen[rank].add(by_inputs[row.numpy().astype("int64").tobytes()])
        # Concatenated in rank order, the ranks' micro-batches are exactly the global batch.
        assert torch.equal(torch.cat(parts), ref)
    for a in range(world):
        assert len(seen[a]) == STEPS * MBS, "a rank read the same sample twice"
        for b in range(a + 1, world):
            assert not seen[a] & seen[b], f"ranks {a} and {b} share samples"


def test_one_process_on_the_global_batch_matches(first_runs, single_node):
    """Observed disjointness: if ranks overlapped or skipped samples, one process reading the
    whole global batch (micro_batch_size x 4, no expert parallelism) would see other data and
    other losses."""
    _, run_dir = _finished(first_runs["one"])
    one = losses(run_dir)
    assert sorted(one) == sorted(single_node)
    for step, loss in single_node.items():
        assert abs(one[step] - loss) <= 1e-5 * max(1.0, abs(loss)), (step, one[step], loss)


@pytest.mark.long  # (a killed worker restarted and resumed is in the default suite: test_resume.py)
def test_killed_node_restarts_and_resumes_from_last_checkpoint(data_overrides, tmp_path):
    """Node 1's agent and workers are killed (SIGKILL, as a node failure) between the first
    and the second checkpoint; node 0's workers lose their peers and its agent gives up. The job is
    started again on both nodes and resumes from the last complete checkpoint and finishes.
    Steps trained both before the kill and after the resume give the same losses (exact
    resume)."""
    from moetrain.checkpoint.catalog import latest_complete
    from moetrain.checkpoint.format import step_of

    steps, every = 24, 10
    ov = [
        *data_overrides,
        f"train.max_steps={steps}",
        f"checkpoint.save_every_steps={every}",
        "checkpoint.keep_last=100",
        "checkpoint.resume=auto",
    ]
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    nodes = start_two_nodes(tmp_path / "first", run_dir, ov, MAX_RESTARTS="0")
    try:
        end = time.monotonic() + 240  # a guard: startup alone can take a minute on 2 busy cores
        # Kill between checkpoints: after the first one, once two more steps are logged (the
        # next checkpoint is 8 steps away), so that some steps are trained twice.
        while not (
            latest_complete(ckpts) is not None
            and max((s for s, _ in logged_losses(run_dir)), default=0) >= every + 2
        ):
            assert time.monotonic() < end, "no complete checkpoint:\n" + nodes[0].output()[-3000:]
            assert all(n.proc.poll() is None for n in nodes), nodes[0].output()[-3000:]
            time.sleep(0.05)
        nodes[1].kill()
        killed_at = max(s for s, _ in logged_losses(run_dir))
        assert killed_at < steps, "the run finished before the kill: make it longer"
        # The surviving node notices (gloo: connection reset) and its agent exits with an error.
        assert nodes[0].wait(timeout=120) != 0, nodes[0].output()[-3000:]
        resume_from = step_of(latest_complete(ckpts))
        nodes = start_two_nodes(tmp_path / "again", run_dir, ov, MAX_RESTARTS="0")
        codes = [n.wait(timeout=240) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    outs = nodes[0].output() + nodes[1].output()
    assert codes == [0, 0], f"exit codes {codes}\n{outs[-4000:]}"
    assert f"resumed from {ckpts / f'step_{resume_from:08d}'}" in outs, outs[-3000:]
    log = logged_losses(run_dir)
    assert sorted(losses(run_dir)) == list(range(1, steps + 1))
    # Split the log where the step counter goes back: before = first run, after = resumed run.
    cut = next(i for i in range(1, len(log)) if log[i][0] <= log[i - 1][0])
    first_run, resumed = dict(log[:cut]), log[cut:]
    assert resumed[0][0] == resume_from + 1, (resumed[0], resume_from)
    assert [s for s, _ in resumed] == list(range(resume_from + 1, steps + 1))
    overlap = [(s, loss) for s, loss in resumed if s in first_run]
    assert overlap, "no step was trained both before the kill and after the resume"
    for step, loss in overlap:
        assert abs(first_run[step] - loss) <= 1e-6, (step, first_run[step], loss)
