"""The product's import graph: no cycle, and the ground floor (common/) imports nothing above it.

Every import counts, module-level and inside functions (a lazy import that closes a loop is
still a loop: which module is complete first then depends on who imports first)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "client", "strategies", "server", "runtime", "tools", "flatflower")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (anywhere in its code)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_product_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_common_imports_nothing_above_it():
    above = {m: sorted(d for d in deps if not d.startswith("common"))
             for m, deps in import_graph().items() if m.startswith("common")}
    assert {m: d for m, d in above.items() if d} == {}


def test_imports_go_one_way():
    """common <- client <- strategies <- server, tools: no client module but the ClientApp
    imports the server halves (a rule never sees server code), and strategies import neither
    the server's run loop nor the tools."""
    graph = import_graph()
    found = {m: sorted(d for d in deps if d.split(".")[0] in forbidden)
             for m, deps in graph.items()
             for forbidden in [{"client": {"strategies", "server", "tools"},
                                "strategies": {"server", "tools"}}.get(m.split(".")[0], set())]
             if m != "flatflower.client.app"}
    assert {m: d for m, d in found.items() if d} == {}


def test_nothing_below_the_commands_imports_them():
    """tools/ is the user's commands only, a thin layer over the rest: no module of the runtime
    (engines, vectorised trainer, SuperNode worker, certificates) nor of common/, client/,
    server/, strategies/ imports it (the public API, flatflower/, is the one floor above the
    commands: it prepares a run as they do); and the runtime is above the ServerApp and the
    ClientApp (the code a FAB runs imports none of it)."""
    graph = import_graph()
    assert {m: sorted(d for d in deps if d.split(".")[0] == "tools")
            for m, deps in graph.items() if m.split(".")[0] not in ("tools", "flatflower")
            and any(d.split(".")[0] == "tools" for d in deps)} == {}
    inside = ("common", "client", "strategies", "server")
    assert {m: sorted(d for d in deps if d.split(".")[0] == "runtime")
            for m, deps in graph.items() if m.split(".")[0] in inside
            and any(d.split(".")[0] == "runtime" for d in deps)} == {}


def test_no_class_is_imported_by_name():
    """The halves are joined by real imports (strategies/registry.py), not 'module:Class' strings;
    the one importer of names is common/references.py, for the user's own code (model, dataset,
    train-transform), which flatflower cannot import by name."""
    hits = []
    for name, path in _modules().items():
        if name == "flatflower.common.references":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "import_module":
                hits.append(name)
            if isinstance(node, ast.Name) and node.id in ("__import__", "import_module"):
                hits.append(name)
    # flatflower.common.references is the one importer of the user's own code (model = package.module:callable)
    assert [h for h in hits if h != "flatflower.common.references"] == []
