"""moetrain/model is single-device code: it never imports torch.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

import moetrain.model

MODEL_DIR = Path(moetrain.model.__file__).parent


def distributed_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("torch.distributed"):
                found.append(node.module)
            elif node.module == "torch":
                found += [f"torch.{a.name}" for a in node.names if a.name == "distributed"]
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            found.append("torch.distributed (attribute)")
    return found


def test_detector_catches_each_form() -> None:
    for src in [
        "import torch.distributed as dist",
        "from torch.distributed import all_reduce",
        "from torch import distributed",
        "import torch\ntorch.distributed.all_reduce(x)",
    ]:
        assert distributed_uses(src), src
    assert not distributed_uses("import torch\nimport torch.nn.functional as F")


def test_model_package_never_imports_torch_distributed() -> None:
    files = sorted(MODEL_DIR.rglob("*.py"))
    assert len(files) >= 8
    offenders = {str(f): u for f in files if (u := distributed_uses(f.read_text()))}
    assert offenders == {}
