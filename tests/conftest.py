"""Settings for every test and every process a test starts; the shared fixtures.

The helpers themselves live in tests/helpers/ (``from tests.helpers.configs import tiny_config``).
"""

from __future__ import annotations

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
# that other work on the machine with another ninja does not invalidate it either.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "torch_extensions"
        / f"moetrain-tests-py{sys.version_info.major}{sys.version_info.minor}"
    ),
)


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
