"""The settings tests/conftest.py gives every process of the suite stay true to the product."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPILES = re.compile(r"torch\.compile\b|torch\._dynamo|torch\.compiler\b|\bdynamo\b")


def test_moetrain_compiles_nothing_with_torchdynamo() -> None:
    """The suite runs with TORCHDYNAMO_DISABLE=1 (only DeepSpeed's unused Muon kernels are
    compiled at import); code of moetrain's own that compiles would then run eagerly in every
    test. Whoever adds some: let its tests run it compiled, then update this test."""
    users = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "moetrain").rglob("*.py"))
        if COMPILES.search(path.read_text())
    ]
    assert users == []
