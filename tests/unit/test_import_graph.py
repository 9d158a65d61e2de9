"""The modules of ``kv_slot_tracker/`` import each other one way: no new import circle, not even a lazy one.

Every ``import`` / ``from … import`` naming a ``kv_slot_tracker`` module is an edge, wherever it stands (at
the top, inside a function, under ``TYPE_CHECKING``): a circle through a function-level import is
still two modules that each need the other. A package's ``__init__`` counts as its own module,
and importing ``pkg.a.b`` also depends on ``pkg.a`` (Python runs the package first); a module's
import of its own enclosing packages is no edge (they are initialised before it in any case).
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "kv_slot_tracker"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(APP.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The ``kv_slot_tracker`` modules that ``path`` imports (a name imported from a package may be a module)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            # the module itself, or the deepest service module that the dotted name falls in
            while name and name not in modules:
                name = name.rpartition(".")[0]
            # a module's own packages run before it anyway: importing them is no circle
            if name and name != here and not here.startswith(name + "."):
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(APP.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    # importing pkg.a.b runs pkg.a first: a package edge for every parent
    for name, targets in graph.items():
        for target in list(targets):
            parent = target.rpartition(".")[0]
            while parent and not name.startswith(parent + ".") and parent != name:
                targets.add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert (
        "kv_slot_tracker.service.selection.service"
        in graph["kv_slot_tracker.http.selection.operations"]
    )
    assert "kv_slot_tracker.core.tracker" in graph["kv_slot_tracker.service.registry"]


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The circles left (none now). The list only shrinks: a new circle fails, and so does one that is
# gone but still listed here.
KNOWN_CIRCLES: list[list[str]] = []


def test_app_has_no_new_import_circle() -> None:
    assert sorted(cycles(import_graph())) == sorted(KNOWN_CIRCLES)
