"""The import graph of ``rl/`` and ``transfer/``, read from the source with ``ast``: it has no
cycle, and ``transfer/`` imports nothing from ``rl/`` (docs/architecture.md, "Layers").

Every import statement counts, wherever it sits: at the top of a module, inside a function
or a class, under ``if TYPE_CHECKING:``. An edge goes to the most specific module named
(``from transfer.data import codec`` -> ``transfer.data.codec``); the parent packages that
Python runs on the way are not edges, as in any import-cycle linter (else every package
whose ``__init__`` imports its own submodules would read as a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import transfer

ROOT = Path(transfer.__file__).resolve().parent.parent
PACKAGES = ("rl", "transfer")


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of ``PACKAGES`` under ``root``."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement of ``source`` names, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{a.name}" for a in node.names)
            names.add(base)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``PACKAGES`` it imports."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        found = imported_names(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {t for t in map(resolve, found) if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search meets, each as a path back to its start; [] if none."""
    found, done, stack = [], set(), []
    on_stack: dict[str, int] = {}

    def visit(node: str) -> None:
        on_stack[node] = len(stack)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                found.append(stack[on_stack[nxt]:] + [nxt])
            elif nxt not in done:
                visit(nxt)
        stack.pop()
        del on_stack[node]
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return found


def test_the_graph_reads_imports_inside_functions_and_relative_ones():
    source = ("import transfer.net\n"
              "from . import codec\n"
              "def f():\n"
              "    from transfer.data.mooncake import client\n")
    assert imported_names(source, "transfer.data.base", is_package=False) >= {
        "transfer.net", "transfer.data.codec", "transfer.data.mooncake.client"}
    graph = import_graph(ROOT)
    assert "transfer.weights.p2p" in graph["rl.backends"]  # imported inside a method there


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_rl_and_transfer_have_no_import_cycle():
    assert cycles(import_graph(ROOT)) == []


def test_transfer_imports_nothing_from_rl():
    graph = import_graph(ROOT)
    upward = sorted((m, t) for m, targets in graph.items() if m.split(".")[0] == "transfer"
                    for t in targets if t.split(".")[0] == "rl")
    assert upward == []
