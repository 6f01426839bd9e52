"""Sample-level rollout scheduling: every sample lives its own life (generate -> reward) instead of
waiting at batch barriers.

Why: in a batch-barrier rollout every generator waits for the longest response of its batch, and the
reward stage waits for every generator. Here requests go to generators one by one (least-loaded
first), each finished sample is scored at once, and a prompt's group is judged when its last sample is
scored: groups whose rewards are all equal carry no learning signal under group-relative advantages and
are dropped (dynamic sampling), and new prompts are started in their place. More groups than needed run
at once (``oversample``), so the batch fills from the fastest samples; once it is full, requests still in
flight are aborted. Async training keeps those partials (``partial_rollout``) and resumes them under the
next weights, and keeps finished-but-unused groups in a buffer; a group older than ``max_staleness``
policy versions is dropped.

Multi-domain: a prompt carries a domain, and its samples are scored by that domain's reward roles
(``rollhpc.rollout.scoring``: several roles' components combined with weights); dynamic sampling may be
set per domain, and the stats count groups and tokens per domain.

Pure logic: generators and reward workers are reached through ``GeneratorPort`` / ``RewardPort``
(controller worker-group calls in a run, direct engine calls in a benchmark), so this module imports
neither vLLM nor MPI.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollhpc.rollout.scoring import DomainScoring, Scorer
from rollhpc.rollout.types import Prompt, RolloutStats, Sample

log = logging.getLogger("rollhpc.rollout")


class Pending(Protocol):
    def done(self) -> bool: ...
    def result(self) -> Any: ...


class GeneratorPort(Protocol):
    def submit(self, adds: list[dict[str, Any]], aborts: list[str]) -> Pending:
        """Add requests ``{"id", "prompt", "max_tokens", "seed"}``, abort ids, and step the engine until a
        request finishes; the result is ``{"finished": [(id, completion)], "aborted": [(id, completion)],
        "busy_s": float}`` (completions have token_ids, logprobs, finish_reason, version)."""
        ...


class RewardPort(Protocol):
    def submit(self, items: list[tuple[Any, list[int]]]) -> Pending:
        """Score ``(example, response token ids)`` pairs; the result has one float, or one dict of named
        reward components, per pair."""
        ...


class Done:
    """An already finished call (for ports that run in the caller's thread)."""

    def __init__(self, value: Any):
        self.value = value

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        return self.value


@dataclass(kw_only=True)
class SchedulerConfig:
    group_size: int = 8
    max_tokens: int = 64  # response tokens per sample
    max_inflight_per_generator: int = 64  # requests a generator holds at once (its batch)
    oversample: float = 0.5  # start up to (1 + oversample) x the groups still needed
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal and start new ones
    max_groups_per_batch: int = 0  # stop starting groups after this many in one collect (0: 8 x n_groups)
    partial_rollout: bool = False  # keep aborted partials and resume them in the next collect
    max_staleness: int = 0  # policy versions a group may lag behind the current one (0: on-policy only)
    poll_interval_s: float = 0.0005

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_tokens < 1 or self.max_inflight_per_generator < 1:
            raise ValueError("group_size, max_tokens and max_inflight_per_generator must be >= 1")
        if self.oversample < 0 or self.max_staleness < 0:
            raise ValueError("oversample and max_staleness must be >= 0")


@dataclass
class _Group:
    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)  # scored samples
    live: int = 0  # requests generating or being scored


class RolloutScheduler:
    """Collects batches of scored groups from generators and reward workers; one instance per run
    (it carries partial samples and finished groups from one batch to the next)."""

    def __init__(self, generators: list[GeneratorPort], rewards: list[RewardPort] | dict[str, DomainScoring],
                 config: SchedulerConfig, seed: int = 0):
        """``rewards``: the reward ports of a single domain, or {domain: DomainScoring} (roles and weights)."""
        if not generators or not rewards:
            raise ValueError("the scheduler needs at least one generator and one reward worker")
        self.generators = generators
        self.scorer = Scorer.of(rewards)
        self.config = config
        self.seed = seed
        self.buffer: list[list[Sample]] = []  # complete groups not used yet (async)
        self.carry: dict[int, _Group] = {}  # open groups with their aborted partials (partial rollout)
        self.carry_partials: list[Sample] = []

    # ------------------------------------------------------------------ one batch
    def collect(self, prompts: Iterator[Prompt], n_groups: int, version: int) -> tuple[list[list[Sample]], RolloutStats]:
        """``n_groups`` complete, scored groups (``group_size`` samples each) for policy ``version``."""
        c = self.config
        stats = RolloutStats(generator_busy_s=[0.0] * len(self.generators))
        t0 = time.perf_counter()
        out = self._take_from_buffer(n_groups, version, stats)
        groups: dict[int, _Group] = {}
        load = [0] * len(self.generators)
        owner: dict[str, tuple[int, Sample]] = {}  # request id -> (generator, sample)
        adds: list[list[dict[str, Any]]] = [[] for _ in self.generators]
        calls: dict[int, Pending] = {}
        limit = c.max_groups_per_batch or 8 * n_groups
        exhausted = False

        def place(sample: Sample, prompt_tokens: list[int], max_tokens: int) -> None:
            g = min(range(len(self.generators)), key=lambda i: load[i])
            load[g] += 1
            owner[sample.request_id] = (g, sample)
            adds[g].append({"id": sample.request_id, "prompt": prompt_tokens, "max_tokens": max_tokens,
                            "seed": hash((self.seed, sample.prompt.uid, sample.index, sample.resumes)) & 0x7FFFFFFF})

        for uid, group in self.carry.items():  # resume partials first: they hold work already paid for
            groups[uid] = group
        for s in self.carry_partials:
            s.resumes += 1
            stats.samples_resumed += 1
            place(s, list(s.prompt.tokens) + s.response, (s.prompt.max_tokens or c.max_tokens) - len(s.response))
        self.carry, self.carry_partials = {}, []

        def fill() -> None:
            nonlocal exhausted
            needed = n_groups - len(out)
            room = c.max_inflight_per_generator * len(self.generators) - sum(load)
            while (not exhausted and len(groups) < math.ceil(needed * (1 + c.oversample))
                   and room >= c.group_size and stats.groups_started < limit):
                prompt = next(prompts, None)
                if prompt is None:
                    exhausted = True
                    break
                groups[prompt.uid] = group = _Group(prompt, live=c.group_size)
                stats.groups_started += 1
                stats.count(prompt.domain, "groups_started")
                for i in range(c.group_size):
                    place(Sample(prompt, i), list(prompt.tokens), prompt.max_tokens or c.max_tokens)
                room -= c.group_size

        def finish_group(group: _Group) -> None:
            del groups[group.prompt.uid]
            samples = sorted(group.samples, key=lambda s: s.index)
            if self._uniform(samples):
                stats.groups_dropped_uniform += 1
                stats.count(group.prompt.domain, "groups_dropped_uniform")
            elif version - min(s.version for s in samples) > c.max_staleness:
                stats.groups_dropped_stale += 1
            elif len(out) < n_groups:
                out.append(samples)
            elif c.max_staleness > 0:
                self.buffer.append(samples)

        while len(out) < n_groups:
            fill()
            for g in range(len(self.generators)):
                if g not in calls and (adds[g] or load[g]):
                    calls[g], adds[g] = self.generators[g].submit(adds[g], []), []
            if not calls and not self.scorer.busy():
                log.warning("rollout ran out of prompts or of its group limit (%d started, %d dropped as uniform): "
                            "%d of %d groups", stats.groups_started, stats.groups_dropped_uniform, len(out), n_groups)
                break
            progressed = False
            for g, call in list(calls.items()):
                if not call.done():
                    continue
                progressed = True
                reply = calls.pop(g).result()
                stats.generator_busy_s[g] += reply.get("busy_s", 0.0)
                finished = []
                for rid, comp in reply["finished"]:
                    load[g] -= 1
                    s = _append(owner.pop(rid)[1], comp)
                    stats.tokens_generated += len(s.response)
                    stats.count(s.prompt.domain, "tokens_generated", len(s.response))
                    finished.append(s)
                if finished:
                    self.scorer.submit(finished)
            for s in self.scorer.ready():
                progressed = True
                group = groups.get(s.prompt.uid)
                if group is None:  # its group was abandoned at an earlier batch end
                    continue
                group.samples.append(s)
                group.live -= 1
                if group.live == 0:
                    finish_group(group)
            if not progressed:
                time.sleep(c.poll_interval_s)

        self._stop(calls, owner, load, groups, version, stats)
        stats.wall_s = time.perf_counter() - t0
        out.sort(key=lambda g: g[0].prompt.uid)  # the batch's order must not depend on which group finished first
        return out, stats

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What carries over between batches (finished groups, open groups with their partials): part of a
        run checkpoint, so a resumed run continues them as the uninterrupted run would have."""
        return {"buffer": self.buffer, "carry": self.carry, "carry_partials": self.carry_partials,
                "next_reward": self.scorer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = list(state["buffer"])
        self.carry = dict(state["carry"])
        self.carry_partials = list(state["carry_partials"])
        self.scorer.load_state_dict(state["next_reward"])

    # ------------------------------------------------------------------ helpers
    def _take_from_buffer(self, n_groups: int, version: int, stats: RolloutStats) -> list[list[Sample]]:
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

    def _uniform(self, samples: list[Sample]) -> bool:
        """Dynamic sampling (its domain's setting): a group whose rewards are all equal teaches nothing."""
        return self.scorer.dynamic_sampling(samples[0].prompt.domain, self.config.dynamic_sampling) and len(
            {s.reward for s in samples}) == 1

    def _stop(self, calls: dict[int, Pending], owner: dict[str, tuple[int, Sample]], load: list[int],
              groups: dict[int, _Group], version: int, stats: RolloutStats) -> None:
        """Batch full: abort what is still generating. With partial rollout the partials and their open
        groups are kept for the next batch, and samples that finished meanwhile are scored and kept."""
        c = self.config
        late: list[Sample] = []
        for g, call in calls.items():  # let the calls in flight return, then abort the rest
            reply = call.result()
            stats.generator_busy_s[g] += reply.get("busy_s", 0.0)
            for rid, comp in reply["finished"]:
                late.append(_append(owner.pop(rid)[1], comp))
        by_gen: dict[int, list[str]] = {}
        for rid, (g, _) in owner.items():
            by_gen.setdefault(g, []).append(rid)
        for g, call in [(g, self.generators[g].submit([], ids)) for g, ids in by_gen.items()]:
            reply = call.result()
            stats.generator_busy_s[g] += reply.get("busy_s", 0.0)
            for rid, comp in reply["finished"]:
                late.append(_append(owner.pop(rid)[1], comp))
            for rid, comp in reply["aborted"]:
                s = owner.pop(rid)[1]
                stats.samples_aborted += 1
                if not c.partial_rollout:
                    stats.tokens_discarded += len(s.response) + len(comp.token_ids)
                else:
                    s.finish_reason = "abort"
                    self.carry_partials.append(_append(s, comp))
        if not c.partial_rollout:
            stats.tokens_discarded += sum(len(s.response) for s in late)
            self.scorer.ready(wait=True)  # replies still out belong to groups given up with this batch
            return
        if late:
            self.scorer.submit(late)
        for s in self.scorer.ready(wait=True):
            if (group := groups.get(s.prompt.uid)) is not None:
                group.samples.append(s)
                group.live -= 1
        for uid, group in groups.items():
            if group.live > 0:
                self.carry[uid] = group  # its remaining samples are among carry_partials
                continue
            samples = sorted(group.samples, key=lambda s: s.index)
            if self._uniform(samples):
                stats.groups_dropped_uniform += 1
                stats.count(group.prompt.domain, "groups_dropped_uniform")
            else:
                self.buffer.append(samples)


def _append(s: Sample, comp: Any) -> Sample:
    """Add a generator segment to a sample; its version is the oldest policy that wrote any token."""
    if comp.token_ids:
        s.version = comp.version if not s.response else min(s.version, comp.version)
    s.response += list(comp.token_ids)
    s.logprobs += list(comp.logprobs)
    s.finish_reason = comp.finish_reason
    return s
