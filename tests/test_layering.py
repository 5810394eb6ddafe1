"""The package's layering, read from its source (no imports run): no import circle between
modules of ``overlap_compile``, and the predictor below the pass (nothing under
``overlap_compile/predictor/`` imports from ``overlap_compile.passes``).

Imports are collected with ``ast`` from every .py file of the package, module level and inside
functions alike. For the circles, imports under ``if TYPE_CHECKING:`` are left out (they never
run); for the predictor rule they count too. ``from pkg import name`` is an import of the module
``pkg.name`` where that module exists, else of ``pkg``. Importing a submodule is not counted as
importing its parent package (Python runs the parent's ``__init__`` first, but that is the
parent's own imports, collected from the parent)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "overlap_compile"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of ``tree`` with whether it sits under ``if TYPE_CHECKING:``."""
    found = []

    def walk(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, type_only))
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                walk(child, True)
            for child in node.orelse:
                walk(child, type_only)
            return
        for child in ast.iter_child_nodes(node):
            walk(child, type_only)

    walk(tree, False)
    return found


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The package modules one import statement of ``module`` names."""
    targets = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                targets.add(name)
        return targets
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        base_name = ".".join(base + ([node.module] if node.module else []))
    else:
        base_name = node.module or ""
    if base_name != PACKAGE and not base_name.startswith(PACKAGE + "."):
        return targets
    for alias in node.names:
        sub = f"{base_name}.{alias.name}"
        if sub in known:
            targets.add(sub)
        elif base_name in known:
            targets.add(base_name)
    return targets


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, bool]]:
    """{module: {imported package module: True if every such import is under TYPE_CHECKING}}."""
    files = module_files(root, package)
    known = set(files)
    graph: dict[str, dict[str, bool]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[str, bool] = {}
        for node, type_only in _import_nodes(tree):
            for target in _resolve(module, path.name == "__init__.py", node, known):
                if target != module:
                    edges[target] = edges.get(target, True) and type_only
        graph[module] = edges
    return graph


def _runtime(graph: dict[str, dict[str, bool]]) -> dict[str, list[str]]:
    return {m: sorted(t for t, type_only in e.items() if not type_only and t in graph) for m, e in graph.items()}


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components of more than one module (runtime imports only): every
    module of one imports, through the others, itself."""
    runtime = _runtime(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in runtime[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(runtime):
        if v not in index:
            strongconnect(v)
    return comps


def circle_in(comp: list[str], runtime: dict[str, list[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    inside = set(comp)
    start = comp[0]
    previous = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in runtime[v]:
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if w in inside and w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_no_import_circle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles between modules of overlap_compile:\n" + "\n".join(
        f"{' -> '.join(circle_in(c, _runtime(graph)))}   (all of: {', '.join(c)})" for c in found)


def test_predictor_imports_nothing_from_passes():
    bad = sorted((m, t) for m, edges in import_graph().items()
                 if m == f"{PACKAGE}.predictor" or m.startswith(f"{PACKAGE}.predictor.")
                 for t in edges if t == f"{PACKAGE}.passes" or t.startswith(f"{PACKAGE}.passes."))
    assert not bad, "the predictor sits below the pass; these modules import from it:\n" + "\n".join(
        f"{m} imports {t}" for m, t in bad)


def test_the_walk_sees_every_kind_of_import(tmp_path):
    """The analysis on a small package: module-level, function-level and relative imports count,
    ``from pkg import module`` names the module, TYPE_CHECKING imports make no circle."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import a\n"
                              "else:\n    import overlap_compile.c\n")
    (pkg / "c.py").write_text("from overlap_compile import sub\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.sub.a": False}
    assert graph[f"{PACKAGE}.sub.a"] == {f"{PACKAGE}.b": False}
    assert graph[f"{PACKAGE}.b"] == {f"{PACKAGE}.sub.a": True, f"{PACKAGE}.c": False}
    # sub -> sub.a -> b -> c -> sub: a circle through a function-level import
    (comp,) = cycles(graph)
    assert comp == [f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.sub", f"{PACKAGE}.sub.a"]
    assert circle_in(comp, _runtime(graph)) == [f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.sub", f"{PACKAGE}.sub.a",
                                                f"{PACKAGE}.b"]
    (pkg / "c.py").write_text("")
    assert cycles(import_graph(pkg)) == []  # b -> sub.a only under TYPE_CHECKING: no circle
