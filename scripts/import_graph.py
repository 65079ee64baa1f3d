"""The import graph of a package: its modules, the arrows between them, and any circles.

    python scripts/import_graph.py [PACKAGE] [ROOT]   # default: stream_gateway in this checkout

An arrow is an import of one of the package's modules by another, wherever it stands (top level or
inside a function: a lazy import is still a dependency). Imports under ``if TYPE_CHECKING:`` are
arrows only for the annotations (``type_checking=True``); the report gives the circles both ways.
The tests use :func:`import_graph` and :func:`circles` to keep the packages free of circles, the
annotations' included.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    """The dotted name of the module at ``path`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.Module, here: str, is_package: bool, type_checking: bool = False) -> list[str]:
    """The absolute names of the modules a module imports when it runs (and, with
    ``type_checking``, for its annotations)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]  # submodules imported by name
    return found


def import_graph(package: str = "stream_gateway", *, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``type_checking``: the annotations' imports too)."""
    paths = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        targets = _runtime_imports(tree, name, path.name == "__init__.py", type_checking)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> None:
    global ROOT
    package = sys.argv[1] if len(sys.argv) > 1 else "stream_gateway"
    if len(sys.argv) > 2:  # another checkout (e.g. an earlier commit's, to compare)
        ROOT = Path(sys.argv[2]).resolve()
    graph = import_graph(package)
    arrows = sum(len(targets) for targets in graph.values())
    annotated = circles(import_graph(package, type_checking=True))
    print(
        f"{package}: {len(graph)} modules, {arrows} import arrows, {len(circles(graph))} circles "
        f"({len(annotated)} with TYPE_CHECKING imports)"
    )
    for circle in circles(graph):
        print("  circle:", " <-> ".join(circle))
    for circle in annotated:
        print("  circle with TYPE_CHECKING imports:", " <-> ".join(circle))
    # The floors: each sub-package (or top-level module) and the others it imports.
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    print(f"  {len(rooms)} rooms, {sum(map(len, rooms.values()))} arrows between them:")
    for name in sorted(rooms):
        print(f"    {name} -> {', '.join(sorted(rooms[name])) or '-'}")


if __name__ == "__main__":
    main()
