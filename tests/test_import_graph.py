"""The package's import graph has no cycles: entry points call downward only.

The graph is read from the source with ``ast``, nothing is imported. An edge A -> B is any
import statement in module A that names module B of the package: at module level, inside a
function, or under ``if TYPE_CHECKING`` (a type-only import is still a dependency of A's
code on B), and ``importlib.import_module("...")`` or ``__import__("...")`` with a literal
name. ``from P import x`` is an edge to ``P.x`` when that is a module, else to ``P``. The
parent packages that Python imports along the way are not edges: ``import a.b.c`` does not
make ``a.b.c`` depend on what ``a/__init__.py`` or ``a/b/__init__.py`` import. A module
named only by a string computed at run time (the fork server runs the module its request
names) is no edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every Python module and C extension source under
    ``root`` (a package's ``__init__.py`` is the package)."""
    out: dict[str, Path] = {}
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _named(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import node (or a literal dynamic import) asks for."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return [mod, *(f"{mod}.{a.name}" for a in node.names)]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported module of the same tree: line of its first import}."""
    mods = modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges: dict[str, int] = {}
        graph[name] = edges
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            asked = _named(node, package)
            if isinstance(node, ast.ImportFrom):
                # ``from P import x``: P.x if it is a module, else P itself
                mod, names = asked[0], asked[1:]
                asked = [n for n in names if n in mods] or [mod]
            for target in asked:
                while target and target not in mods:  # ``import a.b.c``'s module, or a name
                    target = target.rpartition(".")[0]  # in one (``from a.b import f``)
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, dict[str, int]], comp: list[str], root: Path) -> str:
    """One circle: every import inside it, ``a -> b (file:line)``."""
    mods = modules(root)
    lines = [f"import cycle of {len(comp)} modules:"]
    for a in comp:
        for b, line in sorted(graph[a].items()):
            if b in comp:
                lines.append(f"  {a} -> {b}  ({mods[a].relative_to(root)}:{line})")
    return "\n".join(lines)


def test_package_import_graph_has_no_cycles():
    graph = import_graph(SRC)
    assert len(graph) > 50 and "ddiloco.runtime.learner.hook" in graph
    found = cycles(graph)
    assert not found, "\n".join(describe(graph, c, SRC) for c in found)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Negative control: each kind of import closes a cycle that the test reports, and the
    parent packages of an import are not edges."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub import leaf\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")  # function level
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n"
    )
    (pkg / "c.py").write_text("import importlib\nM = importlib.import_module('pkg.a')\n")
    (pkg / "d.py").write_text("from . import e\n")  # relative
    (pkg / "e.py").write_text("import pkg.d as d\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.sub.leaf"] == {}  # its parents' imports are not its own
    assert graph["pkg"] == {"pkg.sub.leaf": 1}
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e"]]
    text = describe(graph, found[0], tmp_path)
    assert "pkg.a -> pkg.b  (pkg/a.py:2)" in text and "pkg.c -> pkg.a  (pkg/c.py:2)" in text
