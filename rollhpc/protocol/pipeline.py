"""Base of the programs the controller runs: a pipeline gets the worker groups and drives them.

Here, below the controller, beside its plan-time side (``rollhpc.protocol.spec.PipelineSpec``: what config and
placement read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollhpc.protocol.spec import PipelineSpec


@dataclass
class RunContext:
    run_dir: Path
    seed: int
    config: Any  # the whole ExperimentConfig, for pipelines that need more than their options
    # role -> parts its colocated ranks offloaded after their start-up turn (controller.startup): where the
    # pipeline's Residency starts
    offloaded_at_start: dict[str, list[str]] = field(default_factory=dict)


class Pipeline(PipelineSpec):
    """Subclasses set ``run`` (optionally ``setup``: start-up work of the controller's own, overlapping the
    workers' construction); ``required_roles``, ``Options`` and the plan-time hooks are ``PipelineSpec``'s, which
    a pipeline with a spec module (rollhpc.protocol.spec) subclasses first.
    """

    def __init__(self, workers: dict[str, Any], run: RunContext, options: Any):
        self.workers = workers  # role -> its WorkerGroup (rollhpc.controller.worker_group)
        self.run_ctx = run
        self.options = options

    def setup(self) -> None:
        """The controller's own start-up (data, tokenizer, the checkpoint to resume from), called once before
        ``run``, while the workers are still being built (loading models, starting engines): what it does
        overlaps their start instead of following it. It must not call the workers."""

    def run(self) -> None:
        raise NotImplementedError
