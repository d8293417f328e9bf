"""The embedded default corpus ``builtin:stdlib``: the Python standard library as text.

Built from the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` in sorted order (test
suites, ``site-packages`` and machine-specific ``_sysconfigdata*`` files skipped), so it is the
same on every machine with the same Python version and needs no network. Each module gives two
documents: its source code, and a prose document of its docstrings (module, classes,
functions) headed by their qualified names. It is written once as JSON lines (``{"text": ...}``)
and reused.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from moetrain.fileio import atomic_file

BUILTIN_STDLIB = "builtin:stdlib"
_VERSION = 1  # bump when the document layout changes
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                out.append(Path(dirpath) / name)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _docstrings(tree: ast.Module, module: str) -> str:
    parts = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    parts.append(f"{name}\n\n{doc}")
                visit(child, name)

    doc = ast.get_docstring(tree, clean=True)
    if doc:
        parts.append(f"{module}\n\n{doc}")
    visit(tree, module)
    return "\n\n".join(parts)


def stdlib_documents(root: Path | None = None) -> Iterator[str]:
    """Yield the corpus documents in their fixed order."""
    root = root or stdlib_root()
    for path in stdlib_files(root):
        rel = path.relative_to(root).with_suffix("").as_posix()
        module = rel.replace("/", ".").removesuffix(".__init__")
        text = path.read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        yield f"# {module}\n{text}"
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        prose = _docstrings(tree, module)
        if prose:
            yield prose


def builtin_cache_path(cache_dir: Path) -> Path:
    """Where the corpus of this Python version is cached inside ``cache_dir``."""
    tag = f"py{platform.python_version()}-v{_VERSION}"
    return Path(cache_dir) / f"builtin-stdlib-{tag}.jsonl"


def ensure_builtin_corpus(cache_dir: Path) -> Path:
    """Write the corpus as JSON lines into ``cache_dir`` unless already there; return the path.

    Written to a temporary name, fsynced and renamed, so a partial file is never reused.
    """
    path = builtin_cache_path(cache_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_file(path) as f:
        for doc in stdlib_documents():
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            n += 1
    print(f"builtin:stdlib: wrote {n} documents ({path.stat().st_size / 1e6:.1f} MB) to {path}")
    return path
