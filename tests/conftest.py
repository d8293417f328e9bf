"""Settings for every test and every process a test starts; the shared fixtures.

The helpers themselves live in tests/helpers/ (``from tests.helpers.configs import tiny_config``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

pytest_plugins = ["tests.helpers.corpus"]  # its fixtures (tiny_data) for every test

# Every process the tests start JIT-loads DeepSpeed's shm comm op (deepspeed.comm's TorchBackend)
# through torch.utils.cpp_extension, which runs the first `ninja` on PATH in a shared build
# folder. The virtualenv's ninja (1.13, a DeepSpeed dependency) and a system ninja (1.11) hash
# the build commands differently, so whenever the other one built last, the op is compiled
# again: about a minute of two compilers on 2 cores while every rank waits on the build lock.
# Some tests put the virtualenv's bin first on PATH (they need its torchrun and deepspeed), others
# inherited pytest's PATH, so a suite run alternated between the two and rebuilt several times.
# One PATH for every child (the virtualenv's bin first) and a build folder of the tests' own, so
# that other work on the machine with another ninja does not invalidate it either. The folder is
# one per virtualenv: the build commands name the virtualenv's torch headers, so two checkouts
# sharing a folder would rebuild it for each other.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
_VENV_TAG = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "torch_extensions"
        / f"moetrain-tests-py{sys.version_info.major}{sys.version_info.minor}-{_VENV_TAG}"
    ),
)

# TorchDynamo off in every process the tests start (and in this one): moetrain compiles nothing
# (tests/unit/test_suite_settings.py holds it to that), but DeepSpeed's ZeRO code imports its
# Muon module in every rank, whose torch.compile decorators import TorchInductor: 1.5-2 CPU-s of
# imports per rank, none of it used. Disabled, torch.compile returns the function as it is; every
# value a test checks is computed by the same eager code either way.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def pytest_sessionstart(session):
    """Bytecode for the sources every process a test starts imports, written once.

    Where bytecode is not written (PYTHONDONTWRITEBYTECODE, ``python -B``), every one of the
    suite's hundreds of processes (each rank, launcher and CLI run) would compile moetrain's
    sources again: about 0.3 CPU-s each. Compiled here, they read the cached bytecode instead
    (Python reads it whatever that setting says; a changed source is compiled again)."""
    if not sys.dont_write_bytecode:
        return  # each process writes what it compiles
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in ("moetrain", "tests"):
        compileall.compile_dir(root / package, quiet=2)


# Opt-in markers: a test carrying one runs only when ``-m`` names it.
OPT_IN = {
    "long": "takes minutes: run with -m long",
    "serving": "needs vLLM's CPU build in its own venv (launch/serving-venv.sh): run with -m serving",
}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` (fault-injection loops, resume matrices) or ``serving`` (vLLM) run
    only when ``-m`` names their marker."""
    import pytest

    markexpr = config.getoption("markexpr") or ""
    for marker, reason in OPT_IN.items():
        if marker in markexpr:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


def pytest_collection_finish(session):
    """Build DeepSpeed's shm comm op once, before any test starts ranks that load it.

    Inside a test, the first ranks to start would compile it under their job's timeout while the
    others wait on its file lock, and a rank killed mid-build leaves the lock behind for every
    later test. Built here, a compiler failure shows once, plainly, before the first test. The
    ranks of run_distributed then fork from one server process that imported torch, DeepSpeed
    and this op once (tests/helpers/distributed.py's PRELOADED)."""
    if not any(
        part in ("distributed", "e2e") for item in session.items for part in item.path.parts
    ):
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    from tests.helpers import distributed

    distributed.PRELOADED = True

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)  # as deepspeed.comm.torch.build_shm_op loads it
