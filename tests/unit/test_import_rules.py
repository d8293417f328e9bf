"""The import rules of docs/ARCHITECTURE.md: which package may import which.

Every import counts, at module level or inside a function; only ``if TYPE_CHECKING:`` blocks
(type hints) are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moetrain

ROOT = Path(moetrain.__file__).parent

FORBIDDEN = {  # a package (or module) -> what it may not import
    "model": {"parallel", "train", "checkpoint", "data", "convert", "init_from", "monitor"},
    "checkpoint": {"train", "convert", "init_from", "data", "parallel"},
    "parallel": {"train", "data", "convert", "init_from", "monitor"},
    "data": {"model", "train", "parallel", "convert", "init_from", "monitor"},
    "monitor": {"train", "parallel", "checkpoint", "data", "convert", "init_from"},
    "convert": {"train", "parallel", "monitor"},
    # the format layer, which init_from builds on: families read only the config
    "convert.families": {"model", "checkpoint", "data", "init_from", "fileio"},
    "convert.formats": {"init_from"},
    "convert.hf": {"init_from"},
    "convert.hf_files": {"init_from"},
    "init_from": {"train", "parallel", "monitor", "data"},
    "config": {"model", "train", "checkpoint", "data", "convert", "init_from", "monitor"},
    "plan": {"train"},
    "generate": {"train", "parallel"},
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "moetrain" and len(parts) > 1 else None


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_packages(source: str) -> set[str]:
    """moetrain packages (or top-level modules) that ``source`` imports."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(p for a in node.names if (p := _package(a.name)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "moetrain":
                found.update(a.name for a in node.names)
            elif p := _package(node.module):
                found.add(p)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_detector_sees_every_form_and_skips_type_hints() -> None:
    src = (
        "import moetrain.train.loop\n"
        "from moetrain.parallel import topology\n"
        "from moetrain import data\n"
        "def f():\n    from moetrain.checkpoint.save import Checkpointer\n"
        "if TYPE_CHECKING:\n    from moetrain.convert import hf\n"
    )
    assert imported_packages(src) == {"train", "parallel", "data", "checkpoint"}


def test_packages_import_only_what_the_architecture_allows() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts)
        rules = [v for k, v in FORBIDDEN.items() if module == k or module.startswith(k + ".")]
        bad = imported_packages(path.read_text()) & set().union(*rules)
        offenders += [f"{rel} imports moetrain.{p}" for p in sorted(bad)]
    assert offenders == []
    assert len(list(ROOT.rglob("*.py"))) > 40  # the walk saw the package
