"""The modules of ``kv_slot_tracker/`` import each other one way: no new import circle, not even a lazy one.

Every ``import`` / ``from … import`` naming a ``kv_slot_tracker`` module is an edge, wherever it stands (at
the top, inside a function, under ``TYPE_CHECKING``): a circle through a function-level import is
still two modules that each need the other, and one through a ``TYPE_CHECKING`` import is two
modules that each know the other's types; a one-way layering has neither (the project has no
circle of either kind, so counting them costs nothing and keeps it so). A package's
``__init__`` counts as its own module, and importing ``pkg.a.b`` also depends on ``pkg.a``
(Python runs the package first). A module's import of its own enclosing packages is no edge
(they are initialised before it in any case), unless it takes a name that the package's
``__init__`` defines or re-exports: that name exists only once the ``__init__`` has run that far,
so the module depends on the ``__init__`` and, through it, on what it re-exports.
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "kv_slot_tracker"


def module_name(path: Path, root: Path = APP.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str], root: Path = APP.parent) -> set[str]:
    """The ``kv_slot_tracker`` modules that ``path`` imports (a name imported from a package may be a module)."""
    here = module_name(path, root)
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
            # a name that is no submodule comes from the package's __init__ (defined there or
            # re-exported): an edge to the package even when it encloses this module
            reexport = any(f"{base}.{alias.name}" not in modules for alias in node.names)
            if reexport and base in modules and base != here:
                found.add(base)
        else:
            continue
        for name in names:
            # the module itself, or the deepest package module that the dotted name falls in
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


def test_a_name_taken_from_an_enclosing_package_is_an_edge_to_its_init(tmp_path: Path) -> None:
    pkg = tmp_path / "kv_slot_tracker" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from kv_slot_tracker.pkg.a import A\n")
    (pkg / "a.py").write_text("from kv_slot_tracker.pkg import b\nA = 1\n")
    (pkg / "b.py").write_text("from kv_slot_tracker.pkg import A\n")
    modules = {"kv_slot_tracker.pkg", "kv_slot_tracker.pkg.a", "kv_slot_tracker.pkg.b"}
    # `from kv_slot_tracker.pkg import b`: a submodule; the enclosing package is no edge
    assert imports_of(pkg / "a.py", modules, tmp_path) == {"kv_slot_tracker.pkg.b"}
    # `from kv_slot_tracker.pkg import A`: a re-export, so the package's __init__ is an edge
    assert imports_of(pkg / "b.py", modules, tmp_path) == {"kv_slot_tracker.pkg"}
    graph = {
        m: imports_of(pkg / f"{p}.py", modules, tmp_path)
        for m, p in [
            ("kv_slot_tracker.pkg", "__init__"),
            ("kv_slot_tracker.pkg.a", "a"),
            ("kv_slot_tracker.pkg.b", "b"),
        ]
    }
    assert cycles(graph) == [sorted(modules)]


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The circles left (none now). The list only shrinks: a new circle fails, and so does one that is
# gone but still listed here.
KNOWN_CIRCLES: list[list[str]] = []


def test_app_has_no_new_import_circle() -> None:
    assert sorted(cycles(import_graph())) == sorted(KNOWN_CIRCLES)
