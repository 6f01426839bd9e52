"""rollhpc's imports, read from the source (no module is imported): no file imports itself back through others,
and no folder does either.

Every ``import rollhpc...`` / ``from rollhpc... import`` counts, at module level or inside a function (a lazy
import that points back up a layer is a cycle that merely waits). Folders are rollhpc's subpackages; a top-level
module (``rollhpc/rank.py``) is a folder of its own. With no cycle between folders they fall into layers by
themselves (README.md, "How a run is built"): an import that points up closes a cycle and fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rollhpc"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The rollhpc modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
                if node.level
                else node.module or ""
            )
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rollhpc"


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def test_no_module_imports_itself_back():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles between files: {[sorted(c) for c in cycles]}"


def test_no_folder_imports_itself_back():
    folders: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        for target in targets:
            if _folder(module) != _folder(target):
                folders.setdefault(_folder(module), set()).add(_folder(target))
    cycles = _cycles(folders)
    edges = sorted((a, b) for c in cycles for a in c for b in folders.get(a, ()) if b in c)
    assert not cycles, (
        f"folders importing each other round: {edges} (import downwards, or move the code)"
    )


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [{"a", "b", "c"}]
