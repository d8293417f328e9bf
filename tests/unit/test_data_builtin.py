"""The embedded ``builtin:stdlib`` corpus: what it reads, determinism, cache."""

from __future__ import annotations

import itertools
import json
import sysconfig
from pathlib import Path

from moetrain.data.builtin import (
    builtin_cache_path,
    ensure_builtin_corpus,
    stdlib_documents,
    stdlib_files,
)


def test_file_walk_is_sorted_and_skips_tests_and_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 300
    assert "argparse.py" in rel and "json/__init__.py" in rel
    for r in rel:
        parts = set(r.split("/"))
        assert not parts & {"test", "tests", "site-packages", "__pycache__"}
        assert not r.split("/")[-1].startswith("_sysconfigdata")


def test_documents_are_deterministic_code_and_docstrings():
    first = list(itertools.islice(stdlib_documents(), 40))
    assert first == list(itertools.islice(stdlib_documents(), 40))
    code = [d for d in first if d.startswith("# ")]
    prose = [d for d in first if not d.startswith("# ")]
    assert code and prose
    assert any("def " in d for d in code)


def test_cache_is_written_once_and_reused(tmp_path, monkeypatch):
    import moetrain.data.builtin as builtin

    few = list(itertools.islice(stdlib_documents(), 5))
    monkeypatch.setattr(builtin, "stdlib_documents", lambda: iter(few))
    path = ensure_builtin_corpus(tmp_path)
    assert path == builtin_cache_path(tmp_path)
    assert [json.loads(line)["text"] for line in path.read_text().splitlines()] == few
    monkeypatch.setattr(builtin, "stdlib_documents", lambda: iter(["changed"]))
    assert ensure_builtin_corpus(tmp_path) == path
    assert len(path.read_text().splitlines()) == 5  # reused, not rebuilt
    assert not list(tmp_path.glob(".*tmp*"))
