"""Text environments for agentic RL, named like roles: a short name for the shipped ones (``frozenlake``:
the module ``rollhpc.envs.frozenlake`` and its ``ENV`` class) or ``package.module:Class`` for anyone's own.

Adding an environment is adding a module (or a class anywhere); no list to edit. ``base`` says what an
environment must offer.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from rollhpc.envs.base import ExpertEnv, Step, TextEnv

__all__ = ["TextEnv", "ExpertEnv", "Step", "env_class", "make_env", "available_envs"]


def env_class(name: str) -> type:
    """The environment class ``name`` names; an unknown name raises with the shipped ones listed."""
    if ":" in name:
        module_path, _, attr = name.partition(":")
    else:
        module_path, attr = f"{__name__}.{name}", "ENV"
    if (
        not module_path
        or not attr
        or not all(p.isidentifier() for p in module_path.split(".") + [attr])
    ):
        raise ValueError(
            f"environment {name!r} is neither a short name ({', '.join(available_envs())}) "
            "nor an import path package.module:Class"
        )
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_path == e.name or module_path.startswith(e.name + ".")):
            raise  # the environment's own import failed: show that
        raise ValueError(
            f"unknown environment {name!r}; shipped: {', '.join(available_envs())} "
            "(or give package.module:Class)"
        ) from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"{module_path} has no environment class {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"{name} is not a text environment: it lacks {', '.join(missing)}")
    return cls


def make_env(name: str, options: dict[str, Any] | None = None) -> TextEnv:
    """A new instance of environment ``name`` built with ``options`` (its constructor's keywords)."""
    cls = env_class(name)
    try:
        return cls(**(options or {}))
    except TypeError as e:
        raise ValueError(
            f"environment {name!r} does not take options {sorted(options or {})}: {e}"
        ) from None


def available_envs() -> list[str]:
    """Short names of the shipped environments (modules of this package with an ``ENV`` class)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except ImportError:
            continue
        if isinstance(getattr(module, "ENV", None), type):
            found.append(info.name)
    return sorted(found)
