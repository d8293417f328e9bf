"""What training imports: not the libraries that only reading a source needs (``datasets`` with
pandas and pyarrow, about 100 MiB per rank), which every rank would otherwise carry."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("datasets", "pandas", "pyarrow")


def test_training_does_not_import_the_source_readers() -> None:
    probe = (
        "import sys; import moetrain.cli, moetrain.train.loop, moetrain.train.trainer, "
        "moetrain.train.start, moetrain.data.splits, moetrain.data.blend; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"
