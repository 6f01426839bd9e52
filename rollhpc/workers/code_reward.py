"""Reward role for code answers: run each response's program in a bubblewrap sandbox, score its test results.

The policy's output is untrusted code, so it never runs in this process: the task module
(``rollhpc.tasks.pyfunc`` or any module with the same ``sandbox_limits`` / ``score_components_batch``)
turns each response into one sandboxed program, and this role runs a batch's programs concurrently
(``rollhpc.sandbox.SandboxPool``, one thread per CPU of this rank by default). Each item's reward is a
dict of components, ``{"tests": fraction of hidden tests passed, "format": 0 or -format_penalty}``,
which the scheduler combines with the domain's weights and logs one by one.

Fails closed: constructing the role makes (and preflights) the sandbox, so a node without working
bubblewrap stops the run at start with one message instead of scoring anything unsandboxed.
``unsafe: true`` runs programs as plain subprocesses with the same resource limits and no isolation,
for a laptop without user namespaces; never for a policy's output on a shared machine.
``metrics`` gives the counters a run should log: programs run, timeouts, other failures, mean wall time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rollhpc.protocol.worker import Dispatch, Worker, WorkerContext, register
from rollhpc.rewards.components import Components
from rollhpc.sandbox import Sandbox, SandboxPool, SandboxResult, SandboxUnavailable
from rollhpc.tasks import task_module

__all__ = ["CodeCounters", "CodeRewardWorker"]

log = logging.getLogger(__name__)
CODE_TASK_FUNCTIONS = ("sandbox_limits", "score_components_batch")


@dataclass
class CodeCounters:
    """Since the role started: items scored, programs run (items needing no run are not), how they ended."""

    items: int = 0
    programs: int = 0
    timeouts: int = 0
    errors: int = 0  # any other status than ok or timeout: memory, output_limit, killed, error
    wall_s: float = 0.0  # summed over programs

    def add(self, items: int, results: list[SandboxResult]) -> None:
        self.items += items
        self.programs += len(results)
        self.timeouts += sum(r.status == "timeout" for r in results)
        self.errors += sum(r.status not in ("ok", "timeout") for r in results)
        self.wall_s += sum(r.wall_s for r in results)

    def as_dict(self) -> dict[str, float]:
        return {
            "code_items": self.items,
            "code_programs": self.programs,
            "code_timeouts": self.timeouts,
            "code_errors": self.errors,
            "code_wall_s_mean": round(self.wall_s / self.programs, 4) if self.programs else 0.0,
        }


class CodeRewardWorker(Worker):
    @dataclass(kw_only=True)
    class Options:
        model_dir: str  # where the tokenizer is (the policy checkpoint)
        # a code task: a task module with sandbox_limits and score_components_batch
        task: str = "pyfunc"
        wall_s: float = 5.0  # per program (all of a response's tests): killed after it
        cpu_s: float = 5.0  # per process of a program
        memory_mb: int = 256  # address space per process
        nproc: int = 8  # processes + threads per program
        output_bytes: int = 4096  # stdout/stderr per program
        workers: int | None = None  # programs at once; None: the CPUs this rank may use
        unsafe: bool = False  # run WITHOUT isolation (limits only): never for untrusted code
        # the "format" component is -format_penalty for a malformed response
        format_penalty: float = 0.1

        def __post_init__(self) -> None:
            module = task_module(self.task)
            missing = [f for f in CODE_TASK_FUNCTIONS if not callable(getattr(module, f, None))]
            if missing:
                raise ValueError(
                    f"task {self.task!r} is not a code task: it lacks {', '.join(missing)}"
                )
            self.limits()  # checks the limits (positive, whole numbers where needed)
            if self.workers is not None and self.workers < 1:
                raise ValueError(f"workers must be >= 1 (or None: one per CPU), got {self.workers}")
            if self.format_penalty < 0:
                raise ValueError(f"format_penalty must be >= 0, got {self.format_penalty}")

        def limits(self):
            return task_module(self.task).sandbox_limits(
                wall_s=self.wall_s,
                cpu_s=self.cpu_s,
                memory_mb=self.memory_mb,
                nproc=self.nproc,
                output_bytes=self.output_bytes,
            )

    def __init__(self, ctx: WorkerContext, options: Options):
        super().__init__(ctx, options)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
        self.task = task_module(options.task)
        if options.unsafe:
            log.warning(
                "reward role %s: unsafe=true: the policy's code runs WITHOUT a sandbox", ctx.role
            )
        try:
            self.sandbox = Sandbox(options.limits(), unsafe=options.unsafe)
        except SandboxUnavailable as e:
            raise SandboxUnavailable(
                f"reward role {ctx.role!r} runs the policy's code only in a sandbox, and none can "
                f"be made on this node: {e}"
            ) from None
        self.pool = SandboxPool(self.sandbox, options.workers)
        self.counters = CodeCounters()
        log.info(
            "reward role %s: %s, %d programs at once",
            ctx.role,
            self.sandbox.describe(),
            self.pool.workers,
        )

    @register(Dispatch.DP_SPLIT)
    def score(self, items: list[tuple[Any, list[int]]]) -> list[Components]:
        """``(example, response token ids)`` -> ``{"tests": fraction passed, "format": 0 or -penalty}`` per item."""
        texts = self.tokenizer.batch_decode([ids for _, ids in items], skip_special_tokens=True)
        components, results = self.task.score_components_batch(
            [example for example, _ in items],
            texts,
            self.pool,
            format_penalty=self.options.format_penalty,
        )
        self.counters.add(len(items), results)
        return components

    @register(Dispatch.ONE_TO_ALL)
    def metrics(self) -> dict[str, float]:
        """This rank's counters since start: code_items, code_programs, code_timeouts, code_errors,
        code_wall_s_mean."""
        return self.counters.as_dict()

    def close(self) -> None:
        self.pool.close(cancel_pending=True)
