"""Synthetic tasks with verifiable answers, generated locally (nothing is downloaded).

Each task module offers ``make_splits``, ``format_prompt``, ``completion``, ``score`` and ``corpus``;
``task_module`` finds one by the name configs use: the short name of a module in this package
(``arithmetic``) or the import path of a module anywhere (``mypackage.mytask``). Adding a task is
adding a module; no list to edit.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["TASK_FUNCTIONS", "available_tasks", "task_module"]

TASK_FUNCTIONS = ("make_splits", "format_prompt", "completion", "score", "corpus")


def task_module(name: str) -> ModuleType:
    """The task module named ``name``; an unknown name raises with the tasks found in rollhpc.tasks."""
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(
            f"task name {name!r} is neither a module of rollhpc.tasks nor an import path"
        )
    path = name if "." in name else f"{__name__}.{name}"
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as e:
        # a task's own import failed
        if e.name is None or not (path == e.name or path.startswith(e.name + ".")):
            raise
        raise ValueError(
            f"unknown task {name!r}; tasks in rollhpc.tasks are {', '.join(available_tasks())} "
            "(or give a module's import path, package.module)"
        ) from None
    missing = [f for f in TASK_FUNCTIONS if not callable(getattr(module, f, None))]
    if missing:
        raise ValueError(f"{path} is not a task module: it lacks {', '.join(missing)}")
    return module


def available_tasks() -> list[str]:
    """The modules of this package that are tasks (they define every one of ``TASK_FUNCTIONS``)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if all(callable(getattr(module, f, None)) for f in TASK_FUNCTIONS):
            found.append(info.name)
    return sorted(found)


def __getattr__(name: str) -> tuple[str, ...]:
    """``TASKS``: the task names of this package, found when first asked for (kept for callers that list them)."""
    if name == "TASKS":
        return tuple(available_tasks())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
