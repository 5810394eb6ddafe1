"""The layering of ``overlap_compile`` and of ``benchmarks/``, read from their source (no imports
run): no import circle between modules of either, and the predictor below the pass (nothing under
``overlap_compile/predictor/`` imports from ``overlap_compile.passes``).

Imports are collected with ``ast`` from every .py file (benchmarks/results left out), module level,
inside functions and under ``if TYPE_CHECKING:`` alike: a circle of annotations is still a circle.
``from pkg import name`` is an import of the module ``pkg.name`` where that module exists, else of
``pkg``. A bare ``import name`` / ``from name import ...`` names a module beside the importing file
when there is one (benchmark scripts put their own directory on ``sys.path``). Importing a
submodule is not counted as importing its parent package (Python runs the parent's ``__init__``
first, but that is the parent's own imports, collected from the parent)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "overlap_compile"
REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / PACKAGE
TREES = {PACKAGE: ROOT, "benchmarks": REPO / "benchmarks"}
SKIPPED_DIRS = {"results", "__pycache__"}


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if SKIPPED_DIRS.intersection(parts[:-1]):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _longest_known(name: str, known: set[str]) -> str | None:
    """``name`` or its longest prefix that is a known module."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str],
             package: str = PACKAGE, bare_siblings: bool = False) -> set[str]:
    """The tree's modules one import statement of ``module`` names. ``bare_siblings``: a bare
    name (not under ``package``) names the module of that name beside ``module``, if any."""
    here = module if is_package else module.rpartition(".")[0]

    def in_tree(name: str) -> str | None:
        if name == package or name.startswith(package + "."):
            return name
        if bare_siblings and f"{here}.{name.split('.')[0]}" in known:
            return f"{here}.{name}"
        return None

    targets = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = in_tree(alias.name)
            found = _longest_known(name, known) if name else None
            if found:
                targets.add(found)
        return targets
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        base_name = ".".join(base + ([node.module] if node.module else []))
    else:
        base_name = in_tree(node.module or "")
        if base_name is None:
            return targets
    for alias in node.names:
        sub = f"{base_name}.{alias.name}"
        if sub in known:
            targets.add(sub)
        elif base_name in known:
            targets.add(base_name)
    return targets


def import_graph(root: Path = ROOT, package: str = PACKAGE, bare_siblings: bool = False) -> dict[str, set[str]]:
    """{module: the tree's modules it imports}."""
    files = module_files(root, package)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = {target for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for target in _resolve(module, path.name == "__init__.py", node, known, package, bare_siblings)
                         if target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: every module of one imports,
    through the others, itself."""
    edges = {m: sorted(t for t in targets if t in graph) for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return comps


def circle_in(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    inside = set(comp)
    start = comp[0]
    previous = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
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


def _circles_message(name: str, graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return f"import circles between modules of {name}:\n" + "\n".join(
        f"{' -> '.join(circle_in(c, graph))}   (all of: {', '.join(c)})" for c in found)


def test_no_import_circle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, _circles_message(PACKAGE, graph, found)


def test_no_import_circle_in_benchmarks():
    graph = import_graph(TREES["benchmarks"], "benchmarks", bare_siblings=True)
    assert "benchmarks.e2e_report" in graph and "benchmarks.diagnostics.moe_breakdown" in graph
    found = cycles(graph)
    assert not found, _circles_message("benchmarks", graph, found)


def test_predictor_imports_nothing_from_passes():
    bad = sorted((m, t) for m, targets in import_graph().items()
                 if m == f"{PACKAGE}.predictor" or m.startswith(f"{PACKAGE}.predictor.")
                 for t in targets if t == f"{PACKAGE}.passes" or t.startswith(f"{PACKAGE}.passes."))
    assert not bad, "the predictor sits below the pass; these modules import from it:\n" + "\n".join(
        f"{m} imports {t}" for m, t in bad)


def test_the_walk_sees_every_kind_of_import(tmp_path):
    """The analysis on a small package: module-level, function-level, relative and TYPE_CHECKING
    imports count, ``from pkg import module`` names the module."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import a\n"
                              "else:\n    import overlap_compile.c\n")
    (pkg / "c.py").write_text("from overlap_compile import sub\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.sub.a"}
    assert graph[f"{PACKAGE}.sub.a"] == {f"{PACKAGE}.b"}
    assert graph[f"{PACKAGE}.b"] == {f"{PACKAGE}.sub.a", f"{PACKAGE}.c"}
    # sub -> sub.a -> b -> c -> sub through a function-level import; the shortest circle in it:
    # b -> sub.a (under TYPE_CHECKING) -> b
    (comp,) = cycles(graph)
    assert comp == [f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.sub", f"{PACKAGE}.sub.a"]
    assert circle_in(comp, graph) == [f"{PACKAGE}.b", f"{PACKAGE}.sub.a", f"{PACKAGE}.b"]
    (pkg / "b.py").write_text("import overlap_compile.c\n")
    (comp,) = cycles(import_graph(pkg))
    assert circle_in(comp, import_graph(pkg)) == [f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.sub",
                                                  f"{PACKAGE}.sub.a", f"{PACKAGE}.b"]
    (pkg / "c.py").write_text("")
    assert cycles(import_graph(pkg)) == []


def test_the_walk_of_scripts(tmp_path):
    """Benchmark scripts: ``benchmarks.x`` names, bare names of modules beside the importer (and
    only those: ``import torch`` is no module of the tree), results/ left out."""
    root = tmp_path / "benchmarks"
    (root / "diag").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "results" / "old.py").write_text("import report\n")
    (root / "run.py").write_text("import torch\nfrom benchmarks.report import write\n")
    (root / "report.py").write_text("def write():\n    import run\n")
    (root / "diag" / "one.py").write_text("from two import f\nimport report\n")
    (root / "diag" / "two.py").write_text("import torch.nn\nfrom benchmarks import run\n")
    graph = import_graph(root, "benchmarks", bare_siblings=True)
    assert set(graph) == {"benchmarks.run", "benchmarks.report", "benchmarks.diag.one", "benchmarks.diag.two"}
    assert graph["benchmarks.run"] == {"benchmarks.report"}
    assert graph["benchmarks.report"] == {"benchmarks.run"}
    assert graph["benchmarks.diag.one"] == {"benchmarks.diag.two"}  # report is not beside it
    assert graph["benchmarks.diag.two"] == {"benchmarks.run"}
    assert cycles(graph) == [["benchmarks.report", "benchmarks.run"]]
