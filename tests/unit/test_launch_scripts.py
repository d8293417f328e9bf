"""launch/train.sh, multinode-torchrun.sh, multinode-deepspeed.sh: the command lines they build.

DRY_RUN=1 prints the launcher command instead of running it; GPUS fakes the GPU count so the
launcher choice can be checked on a CPU machine. The scripts really run (on CPU, 2-4 processes)
in tests/e2e/test_multinode.py.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dry(script: str, *args: str, **env: str) -> tuple[list[str], str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    }
    base.update(DRY_RUN="1", PYTHON=sys.executable, **env)
    r = subprocess.run(
        ["bash", f"launch/{script}", *args],
        env=base,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout.strip().splitlines()[-1]), r.stderr


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_train_sh_on_cpu_uses_torchrun_with_two_processes():
    argv, err = dry("train.sh", "configs/tiny-cpu.yaml", "train.max_steps=3", GPUS="0")
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert flag(argv, "--nproc-per-node") == "2" and flag(argv, "--nnodes") == "1"
    assert "--standalone" in argv
    assert argv[-5:] == ["-m", "moetrain", "train", "configs/tiny-cpu.yaml", "train.max_steps=3"]
    assert "launcher=torchrun" in err


def test_train_sh_with_gpus_prefers_deepspeed():
    argv, _ = dry("train.sh", "configs/small-1gpu.yaml", "seed=1", GPUS="8", MASTER_PORT="29123")
    assert Path(argv[0]).name == "deepspeed"
    assert flag(argv, "--num_gpus") == "8" and flag(argv, "--master_port") == "29123"
    assert argv[-5:] == ["--module", "moetrain", "train", "configs/small-1gpu.yaml", "seed=1"]


def test_train_sh_multinode_and_explicit_launchers():
    argv, _ = dry(
        "train.sh",
        GPUS="8",
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29500",
        MAX_RESTARTS="2",
    )
    # several nodes without a hostfile: torchrun with the given node rank and master
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert flag(argv, "--nnodes") == "2" and flag(argv, "--node-rank") == "1"
    assert flag(argv, "--master-addr") == "10.0.0.1" and flag(argv, "--max-restarts") == "2"
    assert flag(argv, "--nproc-per-node") == "8" and "--standalone" not in argv
    assert argv[-1] == "configs/tiny-cpu.yaml"

    argv, _ = dry("train.sh", LAUNCHER="python", NPROC="1", GPUS="0")
    assert argv == [sys.executable, "-m", "moetrain", "train", "configs/tiny-cpu.yaml"]


def test_train_sh_sets_threads_per_process_on_cpu(tmp_path):
    """Not a dry run: the "interpreter" is a script that reports the OMP_NUM_THREADS it got."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\necho "threads=$OMP_NUM_THREADS args=$*"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(GPUS="0", NPROC="1", LAUNCHER="python", PYTHON=str(fake))
    cores = len(os.sched_getaffinity(0))

    def run(**extra: str) -> str:
        r = subprocess.run(
            ["bash", "launch/train.sh", "configs/tiny-cpu.yaml", "seed=5"],
            env={**env, **extra},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert run() == f"threads={cores} args=-m moetrain train configs/tiny-cpu.yaml seed=5"
    assert run(OMP_NUM_THREADS="3").startswith("threads=3 ")


def test_train_sh_refuses_bad_launcher_settings():
    for env in ({"LAUNCHER": "mpirun"}, {"LAUNCHER": "python", "NPROC": "2"}):
        r = subprocess.run(
            ["bash", "launch/train.sh"],
            env={**os.environ, "GPUS": "0", "DRY_RUN": "1", **env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "LAUNCHER" in r.stderr, r.stderr


def test_multinode_torchrun_c10d_and_static():
    argv, _ = dry(
        "multinode-torchrun.sh",
        "configs/mixtral-1b-8gpu.yaml",
        "train.max_steps=5",
        NNODES="4",
        NPROC="8",
        MASTER_ADDR="node01",
        MASTER_PORT="29400",
        RDZV_ID="job7",
        MAX_RESTARTS="3",
    )
    assert flag(argv, "--nnodes") == "4" and flag(argv, "--nproc-per-node") == "8"
    assert flag(argv, "--rdzv-backend") == "c10d"
    assert flag(argv, "--rdzv-endpoint") == "node01:29400" and flag(argv, "--rdzv-id") == "job7"
    assert flag(argv, "--max-restarts") == "3"
    assert argv[-2:] == ["configs/mixtral-1b-8gpu.yaml", "train.max_steps=5"]

    argv, _ = dry(
        "multinode-torchrun.sh", RDZV_BACKEND="static", NODE_RANK="1", MASTER_ADDR="10.0.0.2"
    )
    assert flag(argv, "--node-rank") == "1" and flag(argv, "--master-addr") == "10.0.0.2"
    assert "--rdzv-backend" not in argv


def test_multinode_deepspeed_uses_the_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# comment\n\nworker-1 slots=8\nworker-2 slots=8\n")
    argv, _ = dry(
        "multinode-deepspeed.sh",
        "configs/multinode-8x7b-style.yaml",
        "seed=3",
        HOSTFILE=str(hostfile),
        SSH_PORT="2222",
        NUM_NODES="2",
    )
    assert Path(argv[0]).name == "deepspeed"
    assert flag(argv, "--hostfile") == str(hostfile) and flag(argv, "--launcher") == "pdsh"
    assert flag(argv, "--master_addr") == "worker-1"  # the first host of the hostfile
    assert flag(argv, "--ssh_port") == "2222" and flag(argv, "--num_nodes") == "2"
    assert argv[-5:] == [
        "--module",
        "moetrain",
        "train",
        "configs/multinode-8x7b-style.yaml",
        "seed=3",
    ]


def test_multinode_deepspeed_without_hostfile_is_a_clear_error(tmp_path):
    r = subprocess.run(
        ["bash", "launch/multinode-deepspeed.sh"],
        env={**os.environ, "HOSTFILE": str(tmp_path / "nope")},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "hostfile.example" in r.stderr


def test_multinode_torchrun_runs_a_prepare():
    argv, _ = dry("multinode-torchrun.sh", "configs/tiny-cpu.yaml", COMMAND="prepare", NPROC="3")
    assert flag(argv, "--nproc-per-node") == "3"
    assert argv[-4:] == ["-m", "moetrain", "prepare", "configs/tiny-cpu.yaml"]
    r = subprocess.run(
        ["bash", "launch/multinode-torchrun.sh"],
        env={**os.environ, "DRY_RUN": "1", "COMMAND": "convert", "GPUS": "0"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "COMMAND must be train or prepare" in r.stderr
