"""Base of the programs the controller runs: a pipeline gets the worker groups and drives them.

Here, below the controller, so that config (which refuses an entry that is not a Pipeline, as it does a worker that
is not a Worker) and placement (which reads ``memory_stages``) can see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class RunContext:
    run_dir: Path
    seed: int
    config: Any  # the whole ExperimentConfig, for pipelines that need more than their options
    # role -> parts its colocated ranks offloaded after their start-up turn (controller.startup): where the
    # pipeline's Residency starts
    offloaded_at_start: dict[str, list[str]] = field(default_factory=dict)


class Pipeline:
    """Subclasses set ``required_roles`` (checked at config load), an ``Options`` dataclass, and ``run``
    (optionally ``setup``: start-up work of the controller's own, overlapping the workers' construction), and
    override the class hooks below that they need: each default does nothing.
    """

    required_roles: ClassVar[tuple[str, ...]] = ()
    # stage -> {role: parts it uses}: what colocated roles hold in each stage (placement.memory_plan,
    # controller.colocation); None: everything at once, so offload changes nothing
    memory_stages: ClassVar[dict[str, dict[str, tuple[str, ...]]] | None] = None

    def __init__(self, workers: dict[str, Any], run: RunContext, options: Any):
        self.workers = workers  # role -> its WorkerGroup (rollhpc.controller.worker_group)
        self.run_ctx = run
        self.options = options

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
    def preview(cls, options: Any, n: int = 2, roles: dict[str, Any] | None = None) -> list[str] | None:
        """What ``rollhpc train --dry-run`` shows of the run's inputs (e.g. the first prompts as the policy sees
        them); None: nothing to show."""
        return None

    def setup(self) -> None:
        """The controller's own start-up (data, tokenizer, the checkpoint to resume from), called once before
        ``run``, while the workers are still being built (loading models, starting engines): what it does
        overlaps their start instead of following it. It must not call the workers."""

    def run(self) -> None:
        raise NotImplementedError
