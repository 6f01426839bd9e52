"""What a worker or a pipeline says of itself before anything runs: its options, load-time checks, memory estimate
and preview. A component's spec lives in a light module (no torch, megatron, vllm or transformers at its top) so
that config loading, ``rollhpc plan`` and ``submit --dry-run`` run on a login node; its runtime class subclasses
the spec and imports its heavy libraries at the top of its own module.

Naming convention (``spec_path``): the component ``pkg.mod:Name`` has its spec ``NameSpec`` in the sibling module
``pkg.mod_spec``. A component without one (a third-party worker) is its own spec: the runtime class inherits these
defaults from ``Worker`` / ``Pipeline``."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from rollhpc.parallel import ParallelLayout

__all__ = ["PipelineSpec", "WorkerSpec", "find_spec", "spec_path"]


class WorkerSpec:
    """A role's plan-time side. Subclasses may declare a nested ``Options`` dataclass; the role's ``options`` in the
    config are validated against it at load and passed to the runtime class's ``__init__``."""

    @classmethod
    def check_layout(cls, layout: ParallelLayout) -> None:
        """Raise ValueError for a parallel layout this worker cannot run. Called at config load, so a
        layout the worker would refuse at start-up is refused before any allocation."""

    @classmethod
    def check_model(cls, layout: ParallelLayout, options: Any) -> None:
        """Raise ValueError for a model (``options.model_dir``'s config.json, when it is readable here) that
        this layout cannot split. Called at config load after ``check_layout``; a model that lives only on
        the cluster is checked there, at start-up."""

    @classmethod
    def gpu_memory(
        cls, options: Any, layout: ParallelLayout, shape: Any, *, seq_len: int, gpu_bytes: float
    ) -> dict[str, float] | None:
        """Bytes a rank of this role holds on its GPUs, by part (``rollhpc plan``: placement.memory_plan), for
        the model ``shape`` (placement.memory_plan.ModelShape) and rows of ``seq_len`` tokens on GPUs of
        ``gpu_bytes``; None: this worker does not say."""
        return None


class PipelineSpec:
    """A controller program's plan-time side: ``required_roles`` (checked at config load), an ``Options`` dataclass,
    and the class hooks below; each default does nothing."""

    required_roles: ClassVar[tuple[str, ...]] = ()
    # stage -> {role: parts it uses}: what colocated roles hold in each stage (placement.memory_plan,
    # controller.colocation); None: everything at once, so offload changes nothing
    memory_stages: ClassVar[dict[str, dict[str, tuple[str, ...]]] | None] = None

    @classmethod
    def check_roles(cls, options: Any, roles: dict[str, Any]) -> None:
        """Cross-checks of the options against the configured roles at config load (raise ValueError)."""

    @classmethod
    def prepare(cls, options: Any, seed: int, roles: dict[str, Any] | None = None) -> None:
        """Inputs built before any rank starts (e.g. a warm-start policy); ``roles``: the configured roles."""

    @classmethod
    def prepared_paths(cls, options: Any) -> list[str]:
        """The paths ``prepare`` builds, which therefore need not exist beforehand (``config.missing_inputs``)."""
        return []

    @classmethod
    def preview(
        cls, options: Any, n: int = 2, roles: dict[str, Any] | None = None
    ) -> list[str] | None:
        """What ``rollhpc train --dry-run`` shows of the run's inputs (e.g. the first prompts as the policy sees
        them); None: nothing to show."""
        return None


def spec_path(module: str, name: str) -> tuple[str, str]:
    """``pkg.mod:Name`` -> (``pkg.mod_spec``, ``NameSpec``): the convention ARCHITECTURE.md names."""
    return f"{module}_spec", f"{name}Spec"


def find_spec(module: str, name: str) -> type | None:
    """The spec class of ``module:name`` without importing ``module`` itself; None when it has none. An error
    inside an existing spec module propagates: it must not silently fall back to the heavy runtime."""
    spec_module, spec_name = spec_path(module, name)
    try:
        found = importlib.util.find_spec(spec_module)
    # the component's package itself is missing: the caller's import names it
    except ModuleNotFoundError:
        return None
    if found is None:
        return None
    spec = getattr(importlib.import_module(spec_module), spec_name, None)
    return spec if isinstance(spec, type) else None
