"""Sample-level rollout scheduling: every sample lives its own life instead of waiting at batch barriers.

A sample's life is one small state machine, the same for a single-turn prompt (RLVR) and a multi-turn
episode (agentic RL), with one port per phase::

    [reset: env port] -> generate: generator port -> [step: env port -> generate]* -> score -> judge group

Single-turn samples skip reset and step and are scored by the reward roles; an episode starts with a
reset on the env rank that will host it (its prompt is the env's first observation), alternates
generator turns and env steps until the env ends it (or its row is full), and is scored by its return
(the sum of its turns' rewards; reward roles may score it too, see ``SchedulerConfig``).

Why: in a batch-barrier rollout every generator waits for the longest response of its batch, and the
reward phase waits for every generator. Here requests go to generators one by one (least-loaded
first; an episode's later turns to the generator of its first, whose prefix cache holds the row), each
finished sample is scored at once, and a prompt's group is judged when its last sample is scored: groups
whose rewards are all equal carry no learning signal under group-relative advantages and are dropped
(dynamic sampling), and new prompts are started in their place. More groups than needed run at once
(``oversample``), so the batch fills from the fastest samples; once it is full, requests still in flight
are aborted. ``redundancy`` starts extra samples per group and keeps the first ``group_size`` to finish
(the rest are aborted: this favours short episodes, so the count is logged). A per-sample watchdog warns
after ``warn_after_s`` and abandons a sample after ``abandon_after_s`` (its group then fills from its
redundant samples, or is dropped). Async training keeps aborted partials (``partial_rollout``, single-turn
only) and resumes them under the next weights, and keeps finished-but-unused groups in a buffer; a group
older than ``max_staleness`` policy versions is dropped. With a partial overlap (the trainer on some of the
generators' GPUs) those generators are held out of a batch collected during training until the pipeline
releases them (``HeldGenerators``); the others fill it meanwhile.

Multi-domain: a prompt carries a domain, and its samples are scored by that domain's reward roles
(``rollhpc.rollout.scoring``: several roles' components combined with weights); dynamic sampling may be
set per domain, and the stats count groups and tokens per domain.

Pure logic: generators, env ranks and reward workers are reached through ``GeneratorPort`` / ``EnvPort``
/ ``RewardPort`` (controller worker-group calls in a run, direct engine calls in a benchmark or test), so
this module imports neither vLLM nor MPI.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from rollhpc.rollout import types as _types
from rollhpc.rollout.collect import BatchInFlight, HeldGenerators
from rollhpc.rollout.ports import EnvPort, GeneratorPort, RewardPort
from rollhpc.rollout.scheduler_config import SchedulerConfig
from rollhpc.rollout.scoring import DomainScoring, Scorer
from rollhpc.rollout.types import OpenGroup, Prompt, RolloutStats, Sample

# A run checkpoint pickles the scheduler's state (``state_dict``), each class named by module and name; a
# checkpoint may name these two as ``rollhpc.rollout.scheduler._Group`` and ``...scheduler.EpisodeSeed``.
_Group = OpenGroup
EpisodeSeed = _types.EpisodeSeed


class RolloutScheduler:
    """Collects batches of scored groups from generators (and env ranks) and reward workers; one instance
    per run (it carries partial samples and finished groups from one batch to the next)."""

    def __init__(
        self,
        generators: list[GeneratorPort],
        rewards: list[RewardPort] | dict[str, DomainScoring] | None,
        config: SchedulerConfig,
        seed: int = 0,
        envs: list[EnvPort] | None = None,
        temperature: float | None = None,
    ):
        """``rewards``: the reward ports of a single domain, or {domain: DomainScoring} (roles and weights);
        None when ``envs`` score every sample by its episode's return. ``temperature``: None samples at each
        generator's own; 0 is greedy (evaluation)."""
        if not generators or not (rewards or envs):
            raise ValueError(
                "the scheduler needs at least one generator and one reward worker (or env rank)"
            )
        if envs and config.partial_rollout:
            raise ValueError(
                "partial_rollout is for single-turn samples; an episode aborted at a batch end is "
                "restarted from its seed instead"
            )
        self.generators = generators
        self.envs = list(envs or [])
        self.scorer = Scorer.of(rewards) if rewards else None
        self.config = config
        self.seed = seed
        self.temperature = temperature
        self.buffer: list[list[Sample]] = []  # complete groups not used yet (async)
        # open groups with their aborted partials (partial rollout)
        self.carry: dict[int, OpenGroup] = {}
        self.carry_partials: list[Sample] = []

    # ------------------------------------------------------------------ one batch
    def collect(
        self,
        prompts: Iterator[Prompt],
        n_groups: int,
        version: int,
        held: HeldGenerators | None = None,
    ) -> tuple[list[list[Sample]], RolloutStats]:
        """``n_groups`` complete, scored groups (``group_size`` samples each) for policy ``version``; the
        generators in ``held`` start only once it releases them."""
        stats = RolloutStats(generator_busy_s=[0.0] * len(self.generators))
        t0 = time.perf_counter()
        out = self._take_from_buffer(n_groups, version, stats)
        if held is not None and not set(held.ports) <= set(range(len(self.generators))):
            raise ValueError(
                f"held generators {sorted(held.ports)} outside 0..{len(self.generators) - 1}"
            )
        batch = BatchInFlight(self, prompts, n_groups, version, stats, out, held)
        batch.run()
        stats.wall_s = time.perf_counter() - t0
        # the batch's order must not depend on which group finished first
        out.sort(key=lambda g: g[0].prompt.uid)
        return out, stats

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What carries over between batches (finished groups, open groups with their partials): part of a
        run checkpoint, so a resumed run continues them as the uninterrupted run would have."""
        return {
            "buffer": self.buffer,
            "carry": self.carry,
            "carry_partials": self.carry_partials,
            "next_reward": self.scorer.state_dict() if self.scorer else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = list(state["buffer"])
        self.carry = dict(state["carry"])
        self.carry_partials = list(state["carry_partials"])
        if self.scorer is not None:
            self.scorer.load_state_dict(state["next_reward"])

    # ------------------------------------------------------------------ helpers
    def _take_from_buffer(
        self, n_groups: int, version: int, stats: RolloutStats
    ) -> list[list[Sample]]:
        out = []
        keep = []
        for group in self.buffer:
            if version - min(s.version for s in group) > self.config.max_staleness:
                stats.groups_dropped_stale += 1
            elif len(out) < n_groups:
                out.append(group)
                stats.groups_from_buffer += 1
            else:
                keep.append(group)
        self.buffer = keep
        return out
