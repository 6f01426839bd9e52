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

from rollhpc.protocol import probes
from rollhpc.protocol.dispatch import Dispatch, check_contracts, register

if TYPE_CHECKING:
    from rollhpc.parallel import ParallelLayout

__all__ = ["OffloadingWorkerSpec", "PipelineSpec", "WorkerSpec", "find_spec", "spec_path"]


class WorkerSpec:
    """A role's plan-time side and the controller's view of it. Subclasses may declare a nested ``Options``
    dataclass; the role's ``options`` in the config are validated against it at load and passed to the runtime
    class's ``__init__``.

    A spec declares the role's remote methods (``@register`` on a method whose body raises
    NotImplementedError), so the controller builds its worker groups from the spec alone; the runtime class
    implements them without re-declaring (``dispatch.contract_of`` finds the contract through the MRO), and
    ``dispatch.check_contracts`` refuses, at class creation, a subclass that changes one. The three below
    every role answers."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        check_contracts(cls)

    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> dict[str, Any]:
        """Each rank's role, world and group rank, host and pid."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def placement_probe(self, gpus: bool = True) -> dict[str, Any]:
        """Each rank's host, GPUs, CPU cores and memory now (``probes.placement``)."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def collective_bandwidth(self, probe: probes.CollectiveProbe) -> dict[str, Any]:
        """Time ``probe.op`` (all_reduce or broadcast) among ranks the controller chose, in a process group of
        their own that meets at ``probe.address`` (the cluster check; protocol.probes): the role's own groups are
        left alone. Implemented here: it needs nothing of the rank's state, and torch only when it runs."""
        return probes.collective_bandwidth(probe)

    @classmethod
    def check_layout(cls, layout: ParallelLayout) -> None:
        """Raise ValueError for a parallel layout this worker cannot run. Called at config load, so a
        layout the worker would refuse at start-up is refused before any allocation."""

    @classmethod
    def check_model(cls, layout: ParallelLayout, options: object) -> None:
        """Raise ValueError for a model (``options.model_dir``'s config.json, when it is readable here) that
        this layout cannot split. Called at config load after ``check_layout``; a model that lives only on
        the cluster is checked there, at start-up."""

    @classmethod
    def gpu_memory(
        cls,
        options: object,
        layout: ParallelLayout,
        shape: object,
        *,
        seq_len: int,
        gpu_bytes: float,
    ) -> dict[str, float] | None:
        """Bytes a rank of this role holds on its GPUs, by part (``rollhpc plan``: placement.memory_plan), for
        the model ``shape`` (placement.memory_plan.ModelShape) and rows of ``seq_len`` tokens on GPUs of
        ``gpu_bytes``; None: this worker does not say."""
        return None


class OffloadingWorkerSpec(WorkerSpec):
    """A role that gives its devices' memory up to colocated roles between stages (rollhpc.controller.colocation
    calls these on the ranks that share devices; a role without them stays resident). ``parts``: what to move,
    among ``colocation.OFFLOADABLE``."""

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self, parts: list[str]) -> dict[str, float]:
        """Each rank's seconds (and bytes) moved off its devices, and its GPU memory after."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def reload_states(self, parts: list[str]) -> dict[str, float]:
        """Each rank's seconds (and bytes) moved back onto its devices, and its GPU memory after."""
        raise NotImplementedError


class PipelineSpec:
    """A controller program's plan-time side: ``required_roles`` (checked at config load), an ``Options`` dataclass,
    and the class hooks below; each default does nothing."""

    required_roles: ClassVar[tuple[str, ...]] = ()
    # stage -> {role: parts it uses}: what colocated roles hold in each stage (placement.memory_plan,
    # controller.colocation); None: everything at once, so offload changes nothing
    memory_stages: ClassVar[dict[str, dict[str, tuple[str, ...]]] | None] = None

    @classmethod
    def check_roles(cls, options: object, roles: dict[str, Any]) -> None:
        """Cross-checks of the options against the configured roles at config load (raise ValueError)."""

    @classmethod
    def prepare(cls, options: object, seed: int, roles: dict[str, Any] | None = None) -> None:
        """Inputs built before any rank starts (e.g. a warm-start policy); ``roles``: the configured roles."""

    @classmethod
    def prepared_paths(cls, options: object) -> list[str]:
        """The paths ``prepare`` builds, which therefore need not exist beforehand (``config.missing_inputs``)."""
        return []

    @classmethod
    def preview(
        cls, options: object, n: int = 2, roles: dict[str, Any] | None = None
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
