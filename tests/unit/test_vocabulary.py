"""The failure kinds (rollhpc.rundir.failure_kind) and the wire's envelope kinds (rollhpc.transport.envelope) are
spelled once: no module builds a ``{"kind": ...}`` record or compares a ``"kind"`` against one of their strings
itself. Read from the source (nothing is imported but the two vocabularies)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

from rollhpc.rundir.failure_kind import FailureKind
from rollhpc.transport.envelope import Kind

PACKAGE = Path(__file__).resolve().parents[2] / "rollhpc"
HOMES = {PACKAGE / "rundir" / "failure_kind.py", PACKAGE / "transport" / "envelope.py"}
ENVELOPE_KINDS = {v for k, v in vars(Kind).items() if k.isupper()}
SPELLED = ENVELOPE_KINDS | {k.value for k in FailureKind}


def _is_kind(node: ast.AST) -> bool:
    """``x["kind"]`` or ``x.get("kind", ...)``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "kind"
    )


def _spelled_again(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found += [
                (v.lineno, v.value)
                for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant)
                and k.value == "kind"
                and isinstance(v, ast.Constant)
                and v.value in SPELLED
            ]
        elif isinstance(node, ast.Compare) and _is_kind(node.left):
            found += [
                (c.lineno, c.value)
                for c in node.comparators
                if isinstance(c, ast.Constant) and c.value in SPELLED
            ]
    return found


def test_no_module_spells_a_failure_or_envelope_kind_itself():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in HOMES
        for line, value in _spelled_again(ast.parse(path.read_text()))
    ]
    assert not found, f"kinds spelled outside their vocabulary: {found}"


def test_the_finder_finds_a_kind_spelled_again():
    tree = ast.parse(
        'r = {"kind": "lost_peer"}\nif env["kind"] == "bye": pass\nif f.get("kind") == "error": pass'
    )
    assert [v for _, v in _spelled_again(tree)] == ["lost_peer", "bye", "error"]


def test_envelope_kinds_travel_as_the_plain_strings_they_always_were():
    """Envelopes are pickled per message: a plain str is what older peers sent, and the cheapest to unpickle."""
    assert len(ENVELOPE_KINDS) == 8 and all(type(v) is str for v in ENVELOPE_KINDS)
    assert pickle.dumps({"kind": Kind.RESULT}, protocol=5) == pickle.dumps(
        {"kind": "result"}, protocol=5
    )
