"""Exits non-zero, printing the cycle, when the modules of src/pdmask import each other in a circle.

The graph has an edge A -> B for every ``import``/``from ... import`` of B in A, at module level or inside a
function (a deferred import still ties the two modules together), and an edge from a module to the package
``__init__`` that importing it runs first.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, here: str, is_package: bool) -> set[str]:
    """The pdmask modules ``tree`` imports (absolute or relative), each as the longest dotted name that is one."""
    names: set[str] = set()
    package = here if is_package else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # ``from pkg import module``
    return {n for n in names if n == "pdmask" or n.startswith("pdmask.")}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / "pdmask").rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = {t for t in imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py") if t in files}
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: edges to the packages above each target.
        for t in list(targets):
            parts = t.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts)))
        edges[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [m0, m1, ..., m0], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def main() -> int:
    cycle = find_cycle(graph())
    if cycle is None:
        print("check_imports: no import cycle in src/pdmask")
        return 0
    print("check_imports: src/pdmask has an import cycle:\n  " + "\n  -> ".join(cycle), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
