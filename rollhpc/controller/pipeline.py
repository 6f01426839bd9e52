"""Base of the programs the controller runs: a pipeline gets the worker groups and drives them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rollhpc.controller.worker_group import WorkerGroup


@dataclass
class RunContext:
    run_dir: Path
    seed: int
    config: Any  # the whole ExperimentConfig, for pipelines that need more than their options


class Pipeline:
    """Subclasses set ``required_roles`` (checked at config load), an ``Options`` dataclass, and ``run``
    (optionally ``setup``: start-up work of the controller's own, overlapping the workers' construction).

    Optional classmethods: ``check_roles(options, roles)`` (cross-checks at config load), ``prepare(options,
    seed, roles)`` (inputs built before any rank starts; ``roles``: the configured roles) and ``prepared_paths(options)`` (the paths ``prepare``
    builds, which therefore need not exist beforehand: ``config.missing_inputs``).
    """

    required_roles: ClassVar[tuple[str, ...]] = ()

    def __init__(self, groups: dict[str, WorkerGroup], run: RunContext, options: Any):
        self.groups = groups
        self.run_ctx = run
        self.options = options

    def setup(self) -> None:
        """The controller's own start-up (data, tokenizer, the checkpoint to resume from), called once before
        ``run``, while the workers are still being built (loading models, starting engines): what it does
        overlaps their start instead of following it. It must not call the workers."""

    def run(self) -> None:
        raise NotImplementedError
