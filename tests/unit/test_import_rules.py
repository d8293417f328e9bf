"""The import rules of docs/ARCHITECTURE.md: the layers, lowest first, which package may import
which, and no import cycle between modules.

Every import counts, at module level or inside a function; only ``if TYPE_CHECKING:`` blocks
(type hints) are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moetrain

ROOT = Path(moetrain.__file__).parent

# Lowest first: a module imports only from its own layer and the ones before it. A layer is a
# package of moetrain or one of its top-level modules ("moetrain": the package's __init__); a
# dotted entry is a part of a package with a layer of its own (convert's format layer, which
# init_from builds on, below the importer and exporter, which use init_from).
LAYERS = (
    "moetrain",
    "fileio",
    "faults",
    "rank_env",
    "config",
    "redact",
    "model",
    "model_numbers",
    "plan_traffic",
    "data",
    "monitor",
    "optim",
    "checkpoint",
    "parallel",
    "convert.families",
    "convert.quantized",
    "convert.formats",
    "convert.hf_files",
    "convert.weight_entries",
    "convert.mixer_names",
    "convert.weight_map",
    "convert.stored_mtp",
    "convert.hf",
    "init_from",
    "convert",
    "train",
    "generate",
    "plan",
    "cli",
    "__main__",
)

FORBIDDEN = {  # a package (or module) -> what it may not import
    "model": {"parallel", "train", "checkpoint", "data", "convert", "init_from", "monitor"},
    "checkpoint": {"train", "convert", "init_from", "data", "parallel"},
    "parallel": {"train", "data", "convert", "init_from", "monitor"},
    "data": {"model", "train", "parallel", "convert", "init_from", "monitor"},
    "monitor": {"train", "parallel", "checkpoint", "data", "convert", "init_from"},
    "optim": {"train", "parallel", "checkpoint", "data", "convert", "init_from"},
    "convert": {"train", "parallel", "monitor"},
    # the format layer, which init_from builds on: families read only the config
    "convert.families": {"model", "checkpoint", "data", "init_from", "fileio"},
    "convert.quantized": {"init_from"},
    "convert.formats": {"init_from"},
    "convert.hf": {"init_from"},
    "convert.hf_files": {"init_from"},
    "convert.weight_entries": {"init_from"},
    "convert.mixer_names": {"init_from"},
    "convert.weight_map": {"init_from"},
    "convert.stored_mtp": {"init_from"},
    "init_from": {"train", "parallel", "monitor", "data"},
    "config": {"model", "train", "checkpoint", "data", "convert", "init_from", "monitor"},
    "plan": {"train"},
    "generate": {"train", "parallel"},
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "moetrain" and len(parts) > 1 else None


def _in_moetrain(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] == "moetrain"


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(source: str) -> set[str]:
    """The moetrain names that ``source`` imports (``from a.b import c`` gives ``a.b.c``:
    :func:`resolve` finds the module it names)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "moetrain")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _in_moetrain(node.module):
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def imported_packages(source: str) -> set[str]:
    """moetrain packages (or top-level modules) that ``source`` imports."""
    return {p for name in imported_modules(source) if (p := _package(name))}


def module_name(path: Path) -> str:
    parts = ("moetrain", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: set[str]) -> str:
    """The module an imported name lives in (itself, or the longest module prefix)."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def layer(module: str) -> str:
    """The longest entry of LAYERS that ``module`` is or lies in (its package otherwise)."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return _package(module) or "moetrain"


def import_graph() -> dict[str, set[str]]:
    """module -> the moetrain modules it imports."""
    paths = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        deps = {resolve(n, modules) for n in imported_modules(path.read_text())}
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer up to a higher one, and modules of no known layer."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    out = []
    for module, deps in sorted(graph.items()):
        if layer(module) not in rank:
            out.append(f"{module}: layer {layer(module)!r} is not in LAYERS (add it in order)")
            continue
        for dep in sorted(deps):
            if rank.get(layer(dep), len(LAYERS)) > rank[layer(module)]:
                out.append(f"{module} (layer {layer(module)}) imports {dep} (higher layer)")
    return out


def test_detector_sees_every_form_and_skips_type_hints() -> None:
    src = (
        "import moetrain.train.loop\n"
        "from moetrain.parallel import topology\n"
        "from moetrain import data\n"
        "def f():\n    from moetrain.checkpoint.checkpointer import Checkpointer\n"
        "if TYPE_CHECKING:\n    from moetrain.convert import hf\n"
    )
    assert imported_packages(src) == {"train", "parallel", "data", "checkpoint"}
    modules = {"moetrain", "moetrain.data", "moetrain.parallel.topology", "moetrain.train.loop"}
    modules |= {"moetrain.parallel", "moetrain.checkpoint.checkpointer"}
    assert {resolve(n, modules) for n in imported_modules(src)} == {
        "moetrain.train.loop",
        "moetrain.parallel.topology",
        "moetrain.data",
        "moetrain.checkpoint.checkpointer",
    }


def test_cycle_and_layer_checks_catch_what_they_guard() -> None:
    graph = {
        "moetrain.data.loader": {"moetrain.data.blend"},
        "moetrain.data.blend": {"moetrain.data.loader", "moetrain.config"},
        "moetrain.config": set(),
    }
    assert find_cycle(graph) == [
        "moetrain.data.blend",
        "moetrain.data.loader",
        "moetrain.data.blend",
    ]
    assert find_cycle({**graph, "moetrain.data.loader": set()}) is None
    upward = {"moetrain.fileio": {"moetrain.config"}, "moetrain.config": set()}
    assert layer_violations(upward) == [
        "moetrain.fileio (layer fileio) imports moetrain.config (higher layer)"
    ]
    assert layer_violations({"moetrain.newpkg.x": set()})[0].startswith("moetrain.newpkg.x: layer")


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


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    assert len(graph) > 40 and any(graph.values())  # the walk saw the package and its imports
    assert find_cycle(graph) is None


def test_layers_point_one_way() -> None:
    assert layer_violations(import_graph()) == []
