"""The shape rules of rollhpc/ (ARCHITECTURE.md, "Code shape"), measured by tools/code_stats.py from the source
text alone: functions fit on a screen, modules stay readable top to bottom, dependencies show at a module's top,
and public types say what they hold."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# the modules allowed over the module limit, and why each one reads best whole
LONG_MODULES_ALLOWED: dict[str, str] = {}


def _code_stats():
    spec = importlib.util.spec_from_file_location("code_stats", REPO / "tools" / "code_stats.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CODE_STATS = _code_stats()
STATS = CODE_STATS.measure(REPO / "rollhpc")


def test_no_function_is_longer_than_the_limit():
    assert STATS.long_functions == [], (
        f"functions over {CODE_STATS.FUNCTION_LIMIT} lines: split them by what they do"
    )


def test_only_the_allowlisted_modules_are_longer_than_the_limit():
    long = {entry.rsplit(" (", 1)[0] for entry in STATS.long_modules}
    assert long <= set(LONG_MODULES_ALLOWED), (
        f"modules over {CODE_STATS.MODULE_LIMIT} lines: {sorted(long - set(LONG_MODULES_ALLOWED))}"
    )
    assert len(LONG_MODULES_ALLOWED) <= 2


def test_imports_sit_at_the_module_top_but_for_the_login_node_and_rank_start_ones():
    assert STATS.in_function_share < 0.10, (
        f"{STATS.imports_in_functions} of {STATS.imports} imports sit inside functions"
    )


def test_annotations_say_what_they_hold():
    assert STATS.bare_any_per_kloc < 3.0, f"{STATS.bare_any} annotations are a bare Any"
