"""No code branches on a token mixer kind's name outside the kind's own modules
(``moetrain/config/mixers/<kind>.py``, ``moetrain/model/mixers/<kind>.py``): what differs
between kinds goes through the mixer protocol (docs/ARCHITECTURE.md, "Adding a token mixer").

A kind's name is a string literal equal to a key of the registry; it may be assigned or passed
(``model.attention = "mla"``, a family's ``attention="mla"``) but not compared (``==``, ``!=``,
``in``), matched (``case "mla":``), looked up (``MIXERS["mla"]``) or made a dispatch table's key.
One exception: a family layout's ``mixer_renames`` (its released tensor names per mixer kind,
data that :mod:`moetrain.convert.weight_map` reads, not a branch of code).
"""

from __future__ import annotations

import ast
from pathlib import Path

import moetrain
from moetrain.config.mixers import MIXER_KINDS

ROOT = Path(moetrain.__file__).parent


def _is_name(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):  # x in ("gqa", "mla")
        return any(_is_name(e, names) for e in node.elts)
    return False


def branches_on_names(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, code)`` of every comparison, match case, subscript or dict key that uses one of
    ``names`` as a string literal."""
    found = []
    tree = ast.parse(source)
    naming_data = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword) and node.arg == "mixer_renames"
    }
    for node in ast.walk(tree):
        if id(node) in naming_data:
            continue
        hit = (
            (isinstance(node, ast.Compare) and _is_name(node.left, names))
            or (isinstance(node, ast.Compare) and any(_is_name(c, names) for c in node.comparators))
            or (isinstance(node, ast.MatchValue) and _is_name(node.value, names))
            or (isinstance(node, ast.Subscript) and _is_name(node.slice, names))
            or (
                isinstance(node, ast.Dict)
                and any(k is not None and _is_name(k, names) for k in node.keys)
            )
        )
        if hit:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def own_modules(kind: str) -> set[Path]:
    return {ROOT / "config" / "mixers" / f"{kind}.py", ROOT / "model" / "mixers" / f"{kind}.py"}


def test_detector_sees_every_form_of_branching_and_nothing_else() -> None:
    names = {"gqa", "mla"}
    branching = (
        'if cfg.attention == "mla":\n    pass\n'
        'ok = "gqa" != kind\n'
        'many = kind in ("gqa", "other")\n'
        'match kind:\n    case "mla":\n        pass\n'
        'cls = MIXERS["gqa"]\n'
        'table = {"mla": 1, "x": 2}\n'
    )
    assert [line for line, _ in branches_on_names(branching, names)] == [1, 3, 4, 6, 8, 9]
    passing = (
        'model.attention = "mla"\nFamily(attention="mla")\nx = kind == other\nf("gqa")\n'
        'Layout(mixer_renames={"mla": {"a": "b"}})\n'
    )
    assert branches_on_names(passing, names) == []


def test_every_kind_has_its_two_modules() -> None:
    for kind in MIXER_KINDS:
        assert all(p.is_file() for p in own_modules(kind)), kind


def test_no_comparison_with_a_mixer_kind_outside_its_module() -> None:
    offenders = []
    paths = sorted(ROOT.rglob("*.py"))
    assert len(paths) > 40  # the walk saw the package
    for path in paths:  # (each file parsed once, for the kinds it does not own)
        foreign = {kind for kind in MIXER_KINDS if path not in own_modules(kind)}
        for line, code in branches_on_names(path.read_text(), foreign):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {code}")
    assert offenders == []
