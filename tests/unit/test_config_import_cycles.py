"""No import cycles among torchtitan/ modules (static: ``import`` / ``from`` statements via ast).

Every import statement counts, at module level and inside functions (a lazy import only
hides a cycle), except those under ``if TYPE_CHECKING:``, which never run. Relative imports
are resolved. ``import torchtitan.x.y`` depends on ``torchtitan.x.y``; ``from torchtitan.x
import y`` depends on ``torchtitan.x`` and, when ``torchtitan/x/y.py`` (or a package) exists,
on ``torchtitan.x.y`` -- except that a module inside package ``torchtitan.x`` importing only
sibling modules that way (``from torchtitan.x import sibling``) depends on the siblings alone:
its own package is necessarily already being imported, so that edge would turn every package
whose ``__init__`` imports its submodules into a cycle. A cycle is reported as its strongly
connected component: the set of modules that all (transitively) import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "torchtitan"




def module_files(root: Path = REPO) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    skip.update(id(n) for n in ast.walk(stmt))
    return skip


def imports_of(module: str, path: Path, source: str, modules: set[str]) -> set[str]:
    """The torchtitan modules ``module`` imports (itself excluded)."""

    def known(name: str) -> str | None:
        while name and name not in modules:  # `import a.b.c` of a non-module: nearest module
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    deps: set[str | None] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    deps.add(known(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            if base.split(".")[0] != PACKAGE:
                continue
            submodules = {f"{base}.{a.name}" for a in node.names} & modules
            deps.update(submodules)
            # A module inside package `base` importing its siblings from it (`from pkg import
            # sibling`) needs only the siblings: its package is already being imported.
            inside = module.startswith(base + ".")
            if not (inside and len(submodules) == len(node.names)):
                deps.add(known(base))
    deps.discard(None)
    deps.discard(module)
    return {d for d in deps if d is not None}


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    files = module_files(root)
    names = set(files)
    return {m: imports_of(m, p, p.read_text(), names) for m, p in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete import path a -> b -> ... -> a inside ``component`` (for messages)."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for dep in sorted(graph[node] & members):
                if dep == start:
                    return [*paths[node], start]
                if dep not in paths:
                    paths[dep] = [*paths[node], dep]
                    nxt.append(dep)
        frontier = nxt
    return component


def describe(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(one_cycle(graph, c)) for c in cycles) or "none"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    assert not cycles, f"import cycles among torchtitan modules: {describe(graph, cycles)}"


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("from torchtitan.sub.c import thing\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import torchtitan.sub.b\n"
        "thing = 1\n"
        "def g():\n    import torchtitan.sub.a.attribute\n"
    )
    (pkg / "sub" / "d.py").write_text("from ..sub import c\n")  # sibling: no package edge
    (pkg / "sub" / "e.py").write_text("from torchtitan.sub import c, thing_from_init\n")
    (pkg / "f.py").write_text("from torchtitan.sub import c\n")  # outside: package edge too
    graph = import_graph(tmp_path)
    assert graph["torchtitan.sub.a"] == {"torchtitan.sub.b"}
    assert graph["torchtitan.sub.c"] == {"torchtitan.sub.a"}  # TYPE_CHECKING import skipped
    assert graph["torchtitan.sub.d"] == {"torchtitan.sub.c"}
    assert graph["torchtitan.sub.e"] == {"torchtitan.sub", "torchtitan.sub.c"}
    assert graph["torchtitan.f"] == {"torchtitan.sub", "torchtitan.sub.c"}
    cycles = import_cycles(graph)
    assert cycles == [["torchtitan.sub.a", "torchtitan.sub.b", "torchtitan.sub.c"]]
    assert describe(graph, cycles) == (
        "torchtitan.sub.a -> torchtitan.sub.b -> torchtitan.sub.c -> torchtitan.sub.a"
    )
