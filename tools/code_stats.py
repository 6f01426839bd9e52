"""Measure the code-shape numbers issue 55 sets targets for, so a change can say what it moved.

    python tools/code_stats.py [--root rollhpc] [--json]

For every .py file under the root: how many imports sit inside functions (a lazy import hides a dependency from
the module's top), how many annotations are a bare `Any` (parameters, returns and annotated assignments whose
annotation is exactly `Any` or `typing.Any`), which functions are over 60 lines and which modules over 600, and
the share of lines over 100 columns. Only `ast` and the file text are read: nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

FUNCTION_LIMIT = 60
MODULE_LIMIT = 600
WIDE_COLUMNS = 100


@dataclass
class Stats:
    """The counts over one tree; `long_functions` and `long_modules` name what is over the limits."""

    files: int = 0
    lines: int = 0
    imports: int = 0
    imports_in_functions: int = 0
    bare_any: int = 0
    wide_lines: int = 0
    long_functions: list[str] = field(default_factory=list)
    long_modules: list[str] = field(default_factory=list)

    @property
    def in_function_share(self) -> float:
        return self.imports_in_functions / self.imports if self.imports else 0.0

    @property
    def bare_any_per_kloc(self) -> float:
        return 1000.0 * self.bare_any / self.lines if self.lines else 0.0

    @property
    def wide_share(self) -> float:
        return self.wide_lines / self.lines if self.lines else 0.0


def _is_bare_any(node: ast.expr | None) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute):
        return node.attr == "Any" and isinstance(node.value, ast.Name) and node.value.id == "typing"
    if isinstance(node, ast.Constant):  # a quoted annotation
        return node.value == "Any"
    return False


def _function_annotations(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr | None]:
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    params += [a for a in (args.vararg, args.kwarg) if a is not None]
    return [p.annotation for p in params] + [fn.returns]


class _Visitor(ast.NodeVisitor):
    """Walks one module, knowing how many functions enclose the current node."""

    def __init__(self, stats: Stats, name: str) -> None:
        self.stats = stats
        self.name = name
        self.depth = 0
        self.qualname: list[str] = []

    def _count_import(self) -> None:
        self.stats.imports += 1
        if self.depth:
            self.stats.imports_in_functions += 1

    def visit_Import(self, node: ast.Import) -> None:
        self._count_import()

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._count_import()

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.stats.bare_any += _is_bare_any(node.annotation)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.qualname.append(node.name)
        self.generic_visit(node)
        self.qualname.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stats.bare_any += sum(_is_bare_any(a) for a in _function_annotations(node))
        self.qualname.append(node.name)
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > FUNCTION_LIMIT:
            self.stats.long_functions.append(f"{self.name}:{'.'.join(self.qualname)} ({length})")
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        self.qualname.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function


def measure(root: Path) -> Stats:
    """The stats over every .py file under `root` (paths in the lists are relative to root's parent)."""
    stats = Stats()
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        name = str(path.relative_to(root.parent))
        stats.files += 1
        stats.lines += len(lines)
        stats.wide_lines += sum(len(line) > WIDE_COLUMNS for line in lines)
        if len(lines) > MODULE_LIMIT:
            stats.long_modules.append(f"{name} ({len(lines)})")
        _Visitor(stats, name).visit(ast.parse(text, filename=str(path)))
    return stats


def _table(stats: Stats) -> str:
    rows = [
        ("files / lines", f"{stats.files} / {stats.lines}"),
        ("imports", str(stats.imports)),
        ("  inside functions", f"{stats.imports_in_functions} ({stats.in_function_share:.1%})"),
        (
            "bare Any annotations",
            f"{stats.bare_any} ({stats.bare_any_per_kloc:.1f} per 1,000 lines)",
        ),
        (f"functions over {FUNCTION_LIMIT} lines", str(len(stats.long_functions))),
        (f"modules over {MODULE_LIMIT} lines", str(len(stats.long_modules))),
        (f"lines over {WIDE_COLUMNS} columns", f"{stats.wide_lines} ({stats.wide_share:.1%})"),
    ]
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    for title, items in (
        ("long functions", stats.long_functions),
        ("long modules", stats.long_modules),
    ):
        if items:
            out += ["", f"{title}:"] + [f"  {item}" for item in items]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parent.parent / "rollhpc"
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    args = parser.parse_args(argv)
    stats = measure(args.root)
    if args.json:
        derived = {
            "in_function_share": stats.in_function_share,
            "bare_any_per_kloc": stats.bare_any_per_kloc,
            "wide_share": stats.wide_share,
        }
        print(json.dumps({**asdict(stats), **derived}, indent=2))
    else:
        print(_table(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
