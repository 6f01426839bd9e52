"""Synthetic tasks with verifiable answers, generated locally (nothing is downloaded).

Each task module offers ``make_splits``, ``format_prompt``, ``completion``, ``score`` and ``corpus``;
``task_module`` finds one by the name configs use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TASKS = ("arithmetic", "countdown")


def task_module(name: str) -> ModuleType:
    """The task's module by name; an unknown name raises with the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks are {', '.join(TASKS)}")
    return importlib.import_module(f"rollhpc.tasks.{name}")
