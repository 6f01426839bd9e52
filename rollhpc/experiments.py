"""Where experiments are found by name: the user's folders first, then the configs rollhpc ships.

``rollhpc train NAME`` looks for NAME.yaml in, first match wins:

1. ``./configs/`` (a project's own experiments, where users keep them beside their data);
2. each folder of ``ROLLHPC_CONFIG_PATH`` (``:``-separated, like ``PATH``: a group's shared configs);
3. the shipped configs: ``configs/`` of a source checkout, or, after ``pip install``, the copy the wheel
   installs under ``<prefix>/share/rollhpc/configs`` (pyproject's data-files).

A path to a ``.yaml`` file is always taken as it is.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_PATH = "ROLLHPC_CONFIG_PATH"
_SOURCE_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
_INSTALLED_CONFIGS = Path(sys.prefix) / "share" / "rollhpc" / "configs"


def shipped_dir() -> Path:
    """The configs that come with rollhpc: a source checkout's, else the installed copy."""
    return _SOURCE_CONFIGS if _SOURCE_CONFIGS.is_dir() else _INSTALLED_CONFIGS


def search_path() -> list[Path]:
    """The folders searched for NAME.yaml, in order (folders that do not exist are left out)."""
    dirs = [Path.cwd() / "configs"]
    dirs += [Path(d).expanduser() for d in os.environ.get(ENV_PATH, "").split(os.pathsep) if d]
    dirs.append(shipped_dir())
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [s.resolve() for s in seen]:
            seen.append(d)
    return seen


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path
    description: str  # the file's first comment sentence, or ""


def find(name: str) -> Path | None:
    for d in search_path():
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    return None


def available() -> list[Experiment]:
    """Every experiment found, by name; one a folder earlier in the search path holds hides a later one."""
    found: dict[str, Experiment] = {}
    for d in search_path():
        for path in sorted(d.glob("*.yaml")):
            if path.stem not in found:
                found[path.stem] = Experiment(path.stem, path, describe(path))
    return sorted(found.values(), key=lambda e: e.name)


def describe(path: Path) -> str:
    """The leading comment's first sentence: what the experiment is, as its author wrote it."""
    lines = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    words = " ".join(lines).strip()
    if ". " in words:
        words = words[: words.index(". ") + 1]
    return words if len(words) <= 110 else words[:107].rstrip() + "..."
