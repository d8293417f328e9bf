"""`moetrain prepare` on several ranks through the real CLI and launchers: plain processes
(RANK/WORLD_SIZE, or srun's SLURM_PROCID/SLURM_STEP_NUM_TASKS), torchrun, and two loopback
"nodes" (two `launch/multinode-torchrun.sh` agents). Every result must be byte-identical to the
one-process prepare of the same source and settings: every file, the index included. A rank
killed in the middle leaves no finished dataset, and a rerun completes from the chunks left.

The corpus: 0.8 MB of standard-library source as a text file, cut into chunks of ~20 kB, a
512-piece tokenizer trained by rank 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from moetrain.config import load_config
from moetrain.data import DataError, build_loader
from tests.e2e.test_multinode import start_two_nodes
from tests.helpers.corpus import run_prepare, write_stdlib_corpus
from tests.helpers.launch import CONFIG, PY, ROOT, env_for, rank_pid

pytestmark = pytest.mark.slow

TORCHRUN = str(Path(PY).parent / "torchrun")


def settings(out: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        "model.vocab_size=512",
        f"data.source={corpus}",
        f"data.output_dir={out}",
        "data.val_fraction=0.05",
        "data.shard_tokens=20000",
        "data.num_proc=1",
        "data.prepare_chunk_mb=0.02",
        "parallel.timeout_minutes=2",
        *extra,
    ]


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def assert_same(got: Path, want: Path) -> None:
    a, b = files(got), files(want)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], f"{got / name} differs from {want / name}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_stdlib_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", 60, 800_000)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One plain process."""
    out = tmp_path_factory.mktemp("ref") / "data"
    run_prepare(CONFIG, settings(out, corpus))
    assert len([p for p in out.iterdir() if p.suffix == ".bin"]) > 4
    return out


def start_ranks(world: int, args: list[str], log: Path, slurm: bool = False) -> list:
    """``world`` plain processes, each told its rank as a launcher would tell it."""
    procs = []
    for rank in range(world):
        if slurm:
            env = env_for(SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS=str(world))
        else:
            env = env_for(RANK=str(rank), WORLD_SIZE=str(world))
        fh = open(log.with_suffix(f".{rank}.log"), "w")  # noqa: SIM115 (closed by the process end)
        cmd = [PY, "-m", "moetrain", "prepare", CONFIG, *args]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT))
    return procs


def test_any_number_of_ranks_gives_the_same_bytes(corpus, reference, tmp_path):
    """2 and 3 plain ranks (the reference is the one-rank case), 2 srun-style ranks and 2
    ranks reading the source as a stream: all at once, each into its own directory. (One
    process with a pool of workers: tests/unit/test_data_prepare.py.)"""
    cases = {
        "two": (2, [], False),
        "three": (3, [], False),
        "srun": (2, [], True),
        "stream": (2, ["data.streaming=true"], False),
    }
    running = {}
    for name, (world, extra, slurm) in cases.items():
        args = settings(tmp_path / name / "data", corpus, *extra)
        running[name] = start_ranks(world, args, tmp_path / name, slurm)
    for name, procs in running.items():
        codes = [p.wait(timeout=300) for p in procs]
        logs = "".join(p.read_text() for p in sorted(tmp_path.glob(f"{name}.*.log")))
        assert codes == [0] * len(codes), f"{name}: {codes}\n{logs[-3000:]}"
        assert_same(tmp_path / name / "data", reference)
        if len(procs) > 1:
            assert "wrote its chunks; rank 0 writes the index" in logs
        assert not list((tmp_path / name).glob(".data.*")), name  # no build directory left


@pytest.mark.long  # the default suite keeps the byte-identity test of every rank count
def test_torchrun_two_ranks_and_a_killed_rank(corpus, reference, tmp_path):
    """Under torchrun: two ranks give the reference's bytes. Then rank 1 is killed once chunks
    are written: no finished dataset, and a one-process rerun completes from what was left."""
    out = tmp_path / "data"
    args = settings(out, corpus)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "moetrain", "prepare", CONFIG]
    r = subprocess.run([*cmd, *args], env=env_for(), cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_same(out, reference)

    killed = tmp_path / "killed" / "data"
    args = settings(killed, corpus, "data.prepare_chunk_mb=0.005")
    log = (tmp_path / "torchrun.log").open("w")
    proc = subprocess.Popen([*cmd, *args], env=env_for(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        end = time.monotonic() + 240
        while len(list(killed.parent.glob(".data.build-*/parts-*/*.docs.npy"))) < 6:
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            assert time.monotonic() < end, "no chunks were written"
            time.sleep(0.02)
        pid = rank_pid(proc.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    (build,) = killed.parent.glob(".data.build-*")
    left = list(build.glob("parts-*/*.docs.npy"))
    assert left and not killed.exists()  # work kept; nothing that looks like a dataset
    with pytest.raises(DataError, match="no shard index"):
        build_loader(load_config(CONFIG, args).data, "train", 2, 0, 1, 0)
    r = subprocess.run(
        [PY, "-m", "moetrain", "prepare", CONFIG, *args],
        env=env_for(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "continuing the unfinished prepare" in r.stdout
    assert_same(killed, reference)
    assert not build.exists()


@pytest.mark.long  # the default suite keeps the byte-identity test of every rank count
def test_two_loopback_nodes(corpus, reference, tmp_path):
    """Two torchrun agents (`launch/multinode-torchrun.sh`, COMMAND=prepare) of two ranks each,
    meeting in a c10d rendezvous on 127.0.0.1: the same bytes as one process."""
    out = tmp_path / "data"
    nodes = start_two_nodes(
        tmp_path / "nodes",
        tmp_path / "run",
        settings(out, corpus),
        COMMAND="prepare",
        MAX_RESTARTS="0",
    )
    try:
        codes = [n.wait(timeout=300) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    both = nodes[0].output() + nodes[1].output()
    assert codes == [0, 0], f"{codes}\n{both[-4000:]}"
    assert all(f"rank {r} of 4 wrote its chunks" in both for r in (1, 2, 3))
    assert_same(out, reference)
