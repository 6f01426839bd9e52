"""One ``RolloutScheduler.collect``: the samples in flight and what moves each from phase to phase.

A sample's phases and the call that ends each: reset (``EnvPort.reset``), generate (``GeneratorPort.submit``),
step (``EnvPort.step``), score (``Scorer``); ``_finished`` takes a sample that has a reward into its group, and
``_judge`` decides a group once it has ``group_size`` samples. ``rollout.scheduler`` says why samples are
scheduled one by one; this module is the state machine that does it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from rollhpc.engines.completion import Completion
from rollhpc.rollout.generator_loads import GeneratorLoads
from rollhpc.rollout.ports import (
    EnvPort,
    GenerationReply,
    GenerationRequest,
    GeneratorPort,
    Pending,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
)
from rollhpc.rollout.scheduler_config import SchedulerConfig
from rollhpc.rollout.scoring import Scorer
from rollhpc.rollout.types import (
    EpisodeSeed,
    EpisodeState,
    OpenGroup,
    Prompt,
    RolloutStats,
    Sample,
)

log = logging.getLogger("rollhpc.rollout")


@dataclass
class HeldGenerators:
    """Generators that take no work until ``release()`` says they may: with a partial overlap, the generator
    ranks on the trainer's GPUs sleep while it trains and join the batch once it is done (``release`` wakes
    them, then returns True). Called on every turn of the scheduler's loop while they are held."""

    ports: frozenset[int]
    release: Callable[[], bool]


class SchedulerState(Protocol):
    """What one collect reads of its ``RolloutScheduler``, and the groups and partials it leaves it."""

    generators: list[GeneratorPort]
    envs: list[EnvPort]
    scorer: Scorer | None
    config: SchedulerConfig
    seed: int
    temperature: float | None
    buffer: list[list[Sample]]  # complete groups not used yet (async)
    carry: dict[int, OpenGroup]  # open groups with their aborted partials (partial rollout)
    carry_partials: list[Sample]


class BatchInFlight:
    """One ``collect``: the samples in flight and what moves them from phase to phase (the module's docstring)."""

    def __init__(
        self,
        sched: SchedulerState,
        prompts: Iterator[Prompt],
        n_groups: int,
        version: int,
        stats: RolloutStats,
        out: list[list[Sample]],
        held: HeldGenerators | None = None,
    ):
        self.s, self.c = sched, sched.config
        self.held = held if held is not None and held.ports else None
        self.t0 = time.perf_counter()
        self.prompts, self.n_groups, self.version = prompts, n_groups, version
        self.stats, self.out = stats, out
        self.groups: dict[int, OpenGroup] = {}
        # requests per generator; those that need a call
        self.load = GeneratorLoads(len(sched.generators))
        # generator request id -> (generator, sample)
        self.owner: dict[str, tuple[int, Sample]] = {}
        self.adds: list[list[GenerationRequest]] = [[] for _ in sched.generators]
        self.aborts: list[list[str]] = [[] for _ in sched.generators]
        self.calls: dict[int, Pending[GenerationReply]] = {}
        self.env_live = [0] * len(sched.envs)  # episodes hosted per env rank
        self.env_queue: list[dict[str, list[ResetRequest | StepRequest]]] = [
            {"reset": [], "step": []} for _ in sched.envs
        ]
        self.env_calls: list[tuple[int, str, Pending]] = []
        # episode id -> its sample, while at an env rank or generating
        self.episodes: dict[str, Sample] = {}
        self.dead: set[str] = set()  # episodes aborted or abandoned: replies about them are ignored
        self.to_close: list[list[str]] = [[] for _ in sched.envs]
        self.limit = self.c.max_groups_per_batch or 8 * n_groups
        self.exhausted = False
        self.next_watch = 0.0  # when the watchdog next looks at the episodes' ages

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        sched, c = self.s, self.c
        # resume partials first: they hold work already paid for
        for uid, group in sched.carry.items():
            self.groups[uid] = group
        for smp in sched.carry_partials:
            smp.resumes += 1
            self.stats.samples_resumed += 1
            self._generate(smp, (smp.prompt.max_tokens or c.max_tokens) - len(smp.response))
        sched.carry, sched.carry_partials = {}, []
        while len(self.out) < self.n_groups:
            if self.held is not None and self.held.release():
                self.held = None
                self.stats.generators_held_s = time.perf_counter() - self.t0
            self._fill()
            self._send()
            # held generators will still come
            if (
                not self.calls
                and not self.env_calls
                and not (sched.scorer and sched.scorer.busy())
                and self.held is None
            ):
                log.warning(
                    "rollout ran out of prompts or of its group limit (%d started, %d dropped as uniform): "
                    "%d of %d groups",
                    self.stats.groups_started,
                    self.stats.groups_dropped_uniform,
                    len(self.out),
                    self.n_groups,
                )
                break
            progressed = self._poll_generators()
            progressed |= self._poll_envs()
            progressed |= self._poll_scorer()
            self._watchdog()
            if not progressed:
                time.sleep(c.poll_interval_s)
        # full before the held generators were released: they waited throughout
        if self.held is not None:
            self.stats.generators_held_s = time.perf_counter() - self.t0
        self._stop()

    def _send(self) -> None:
        wanting = self.load.wanting
        # those with requests to send, aborts, or requests held and no call out
        for g in sorted(wanting):
            if g in self.calls:
                continue
            wanting.discard(g)
            if self.adds[g] or self.aborts[g] or self.load[g]:
                self.calls[g] = self.s.generators[g].submit(self.adds[g], self.aborts[g])
                self.adds[g], self.aborts[g] = [], []
        for r, env in enumerate(self.s.envs):
            for kind in ("reset", "step"):
                if self.env_queue[r][kind]:
                    self.env_calls.append((r, kind, getattr(env, kind)(self.env_queue[r][kind])))
                    self.env_queue[r][kind] = []
            if self.to_close[r]:
                self.env_calls.append((r, "close", env.close(self.to_close[r])))
                self.to_close[r] = []

    # ------------------------------------------------------------------ phases
    def _fill(self) -> None:
        """Start new groups while the batch still needs them and the generators have room."""
        c, stats = self.c, self.stats
        needed = self.n_groups - len(self.out)
        if self.held is None:
            room = c.max_inflight_per_generator * len(self.load) - self.load.total
        else:
            active = self._active()
            room = c.max_inflight_per_generator * len(active) - sum(self.load[g] for g in active)
        while (
            not self.exhausted
            and len(self.groups) < math.ceil(needed * (1 + c.oversample))
            and room >= c.samples_per_group
            and stats.groups_started < self.limit
        ):
            prompt = next(self.prompts, None)
            if prompt is None:
                self.exhausted = True
                break
            if not isinstance(prompt.example, EpisodeSeed) and self.s.scorer is None:
                raise ValueError("single-turn samples need reward roles; the scheduler has none")
            self.groups[prompt.uid] = OpenGroup(prompt, live=c.samples_per_group)
            stats.groups_started += 1
            stats.count(prompt.domain, "groups_started")
            for i in range(c.samples_per_group):
                if isinstance(prompt.example, EpisodeSeed):
                    self._reset(Sample(prompt, i), prompt.example.seed)
                else:
                    self._generate(Sample(prompt, i), prompt.max_tokens or c.max_tokens)
            room -= c.samples_per_group

    def _reset(self, smp: Sample, seed: int) -> None:
        if not self.s.envs:
            raise ValueError(
                "an episode prompt (EpisodeSeed) needs env ranks: the scheduler has none"
            )
        r = min(range(len(self.s.envs)), key=lambda i: self.env_live[i])
        self.env_live[r] += 1
        smp.episode = EpisodeState(
            id=f"{smp.prompt.uid}.{smp.index}", env_rank=r, started=time.perf_counter()
        )
        self.episodes[smp.episode.id] = smp
        self.env_queue[r]["reset"].append(ResetRequest(smp.episode.id, seed))
        self.stats.episodes_started += 1

    def _generate(self, smp: Sample, max_tokens: int) -> None:
        ep = smp.episode
        if ep is not None and ep.generator >= 0:
            g = ep.generator  # the generator that holds this episode's row in its prefix cache
        else:
            g = self.load.least(self.held.ports if self.held is not None else ())
            if ep is not None:
                ep.generator = g
        self.load.change(g, 1)
        self.load.wanting.add(g)
        self.owner[smp.request_id] = (g, smp)
        self.adds[g].append(
            GenerationRequest(
                smp.request_id,
                smp.context,
                max_tokens,
                self._sampling_seed(smp),
                self.s.temperature,
            )
        )

    def _active(self) -> list[int]:
        """The generators that may take work now (all but the held ones)."""
        return [
            g
            for g in range(len(self.s.generators))
            if self.held is None or g not in self.held.ports
        ]

    def _sampling_seed(self, smp: Sample) -> int:
        key = (self.s.seed, smp.prompt.uid, smp.index, smp.resumes)
        if smp.episode is not None:
            key += (len(smp.episode.turn_ends),)
        return hash(key) & 0x7FFFFFFF

    def _poll_generators(self) -> bool:
        progressed = False
        for g, call in list(self.calls.items()):
            if not call.done():
                continue
            progressed = True
            reply: GenerationReply = self.calls.pop(g).result()
            # _send calls it again if it still holds requests (or has new ones)
            self.load.wanting.add(g)
            self.stats.generator_busy_s[g] += reply.busy_s
            finished = []
            for rid, comp in reply.finished:
                entry = self.owner.pop(rid, None)
                if entry is None:  # aborted by redundancy or the watchdog (already off the books)
                    continue
                self.load.change(g, -1)
                smp = entry[1].add_segment(comp)
                # a single-turn sample counts once, whole (a resumed partial's earlier tokens too)
                n = len(comp.token_ids) if smp.episode is not None else len(smp.response)
                self.stats.tokens_generated += n
                self.stats.count(smp.prompt.domain, "tokens_generated", n)
                if smp.episode is not None:
                    self._turn_generated(smp, len(comp.token_ids))
                else:
                    finished.append(smp)
            if finished:
                self.s.scorer.submit(finished)
        return progressed

    def _turn_generated(self, smp: Sample, n_new: int) -> None:
        """A turn's response is in: mark its tokens as generated and hand it to the episode's env rank."""
        ep = smp.episode
        ep.generated += [1] * n_new
        ep.turn_finishes.append(smp.finish_reason)
        ep.turn_ends.append(len(smp.response) - 1)
        ep.state_keys.append(ep.state_key)
        self.env_queue[ep.env_rank]["step"].append(StepRequest(ep.id, smp.response[-n_new:]))

    def _poll_envs(self) -> bool:
        progressed = False
        for entry in list(self.env_calls):
            r, kind, call = entry
            if not call.done():
                continue
            progressed = True
            self.env_calls.remove(entry)
            replies = call.result()
            if kind == "close":
                continue
            for reply in replies:
                smp = self.episodes.get(reply.episode)
                if smp is None or reply.episode in self.dead:
                    continue
                if kind == "reset":
                    self._after_reset(smp, reply)
                else:
                    self._after_step(smp, reply)
        return progressed

    def _after_reset(self, smp: Sample, reply: ResetReply) -> None:
        ep = smp.episode
        if reply.ended:  # no turn to learn from: like an abandoned episode, not a failed one
            log.warning("episode %s: reset failed (%s)", ep.id, reply.ended)
            self.stats.resets_failed += 1
            self.stats.count_reason(f"reset_{reply.ended}")
            self.stats.first_failure = self.stats.first_failure or f"reset: {reply.ended}"
            self._give_up(smp, f"reset {reply.ended}")
            return
        ep.prompt_ids, ep.state_key = list(reply.prompt_ids), reply.state_key
        ep.instruction, ep.observation = reply.instruction, reply.observation
        self._next_turn(smp)

    def _after_step(self, smp: Sample, reply: StepReply) -> None:
        ep = smp.episode
        ep.turn_rewards.append(float(reply.reward))
        ep.actions.append(reply.action)
        ep.observations.append(reply.observation)
        ep.env_step_s += float(reply.step_s)
        ep.tool_calls += bool(reply.use_tool)
        for k, v in reply.metrics.items():
            ep.metrics[k] = ep.metrics.get(k, 0.0) + float(v)
        ep.state_key = reply.state_key
        if reply.success is not None:
            ep.success = bool(reply.success)
        if reply.ended:
            self._end_episode(smp, reply.ended)
        elif reply.terminated or reply.truncated:
            self._end_episode(smp, "terminated" if reply.terminated else "truncated")
        else:
            obs = list(reply.obs_ids)
            smp.response += obs
            smp.logprobs += [0.0] * len(obs)
            ep.generated += [0] * len(obs)
            self._next_turn(smp)

    def _next_turn(self, smp: Sample) -> None:
        """Generate the episode's next turn within its budget, or end it when its row is full (or it has had
        ``max_turns`` turns)."""
        budget = smp.prompt.max_tokens or self.c.max_tokens
        if self.c.max_model_len:
            budget = min(budget, self.c.max_model_len - len(smp.context))
        if self.c.max_turns and len(smp.episode.turn_ends) >= self.c.max_turns:
            self._end_episode(smp, "truncated")
        elif budget <= 0:
            self._end_episode(smp, "row_full")
        else:
            self._generate(smp, budget)

    def _end_episode(self, smp: Sample, finish: str) -> None:
        ep = smp.episode
        ep.finish = finish
        self.stats.episodes_finished += 1
        self.stats.episodes_succeeded += bool(ep.success)
        del self.episodes[ep.id]
        self.env_live[ep.env_rank] -= 1
        if finish not in ("terminated", "truncated", "row_full"):
            self.stats.episodes_failed += 1
            self.stats.count_reason(finish)
            self.stats.first_failure = self.stats.first_failure or finish
        smp.finish_reason = finish
        # the env role may have dropped it already: closing is idempotent
        self.to_close[ep.env_rank].append(ep.id)
        if self.s.scorer is not None and smp.prompt.domain in self.s.scorer.domains:
            # reward roles score the transcript; the env's return is one component
            self.s.scorer.submit([smp])
        else:
            smp.reward = ep.episode_return
            smp.components = {"env": ep.episode_return}
            self._finished(smp)

    def _poll_scorer(self) -> bool:
        if self.s.scorer is None:
            return False
        progressed = False
        for smp in self.s.scorer.ready():
            progressed = True
            if smp.episode is not None:
                smp.components["env"] = smp.episode.episode_return
                smp.reward += smp.episode.episode_return
            self._finished(smp)
        return progressed

    def _finished(self, smp: Sample) -> None:
        group = self.groups.get(smp.prompt.uid)
        # given up, or already full (redundancy)
        if group is None or len(group.samples) >= self.c.group_size:
            return
        group.samples.append(smp)
        group.live -= 1
        if len(group.samples) == self.c.group_size:
            if group.live:  # redundancy: the first group_size to finish win, the rest are aborted
                self.stats.samples_aborted_redundant += group.live
                self._abort_group_rest(group)
            self._judge(group)

    def _judge(self, group: OpenGroup) -> None:
        c, stats = self.c, self.stats
        del self.groups[group.prompt.uid]
        samples = sorted(group.samples, key=lambda x: x.index)
        if self._uniform(samples):
            stats.groups_dropped_uniform += 1
            stats.count(group.prompt.domain, "groups_dropped_uniform")
        elif self.version - min(x.version for x in samples) > c.max_staleness:
            stats.groups_dropped_stale += 1
        elif len(self.out) < self.n_groups:
            self.out.append(samples)
        elif c.max_staleness > 0:
            self.s.buffer.append(samples)

    # ------------------------------------------------------------------ aborts
    def _abort_sample(self, smp: Sample) -> None:
        """Stop a sample wherever it is: its generation request is aborted, its episode closed."""
        rid = smp.request_id
        if rid in self.owner:
            g, _ = self.owner.pop(rid)
            self.aborts[g].append(rid)
            self.load.change(g, -1)
            self.load.wanting.add(g)
        ep = smp.episode
        if ep is not None and ep.id in self.episodes:
            del self.episodes[ep.id]
            self.dead.add(ep.id)
            self.env_live[ep.env_rank] -= 1
            self.to_close[ep.env_rank].append(ep.id)

    def _abort_group_rest(self, group: OpenGroup) -> None:
        uid = group.prompt.uid
        for _, smp in [e for e in self.owner.values() if e[1].prompt.uid == uid]:
            self._abort_sample(smp)
        for smp in [x for x in self.episodes.values() if x.prompt.uid == uid]:
            self._abort_sample(smp)
        group.live = 0

    def _watchdog(self) -> None:
        c = self.c
        if not (c.warn_after_s or c.abandon_after_s) or not self.episodes:
            return
        now = time.perf_counter()
        # the poll loop spins every poll_interval_s; ages need checking far less often
        if now < self.next_watch:
            return
        self.next_watch = now + min(
            1.0, (min(x for x in (c.warn_after_s, c.abandon_after_s) if x)) / 10
        )
        for smp in list(self.episodes.values()):
            ep, age = smp.episode, now - smp.episode.started
            if c.warn_after_s and age > c.warn_after_s and not ep.warned:
                ep.warned = True
                log.warning(
                    "episode %s still running after %.0f s (%d turns, finish pending)",
                    ep.id,
                    age,
                    len(ep.turn_ends),
                )
            if c.abandon_after_s and age > c.abandon_after_s:
                log.warning(
                    "episode %s abandoned after %.0f s (%d turns)", ep.id, age, len(ep.turn_ends)
                )
                self._give_up(smp, "abandoned")

    def _give_up(self, smp: Sample, why: str) -> None:
        """Drop a sample from its group without a reward; the group fills from its redundant samples or,
        when too few are left, is dropped."""
        self._abort_sample(smp)
        if smp.episode is not None:
            smp.episode.finish = why
        self.stats.episodes_abandoned += 1
        group = self.groups.get(smp.prompt.uid)
        if group is None:
            return
        group.live -= 1
        if len(group.samples) + group.live < self.c.group_size:  # it cannot be filled any more
            self._abort_group_rest(group)
            del self.groups[group.prompt.uid]
            self.stats.groups_dropped_abandoned += 1

    def _uniform(self, samples: list[Sample]) -> bool:
        """Dynamic sampling (its domain's setting): a group whose rewards are all equal teaches nothing."""
        scorer, enabled = self.s.scorer, self.c.dynamic_sampling
        if scorer:
            enabled = scorer.dynamic_sampling(samples[0].prompt.domain, enabled)
        return enabled and len({s.reward for s in samples}) == 1

    # ------------------------------------------------------------------ the batch's end
    def _stop(self) -> None:
        """Batch full: abort what is still generating and close the episodes still open. With partial rollout
        the partials and their open groups are kept for the next batch, and samples that finished meanwhile
        are scored and kept."""
        late = self._drain_calls()
        late += self._abort_requests()
        self._close_episodes()
        # a late episode turn has no env step: dropped
        late = [x for x in late if x.episode is None]
        if self.c.partial_rollout:
            self._carry_over(late)
            return
        self.stats.tokens_discarded += sum(len(x.response) for x in late)
        if self.s.scorer is not None:
            # replies still out belong to groups given up with this batch
            self.s.scorer.ready(wait=True)

    def _late_finished(self, g: int, reply: GenerationReply) -> list[Sample]:
        """The samples generator ``g``'s reply finished after the batch was full (``_stop``'s calls)."""
        self.stats.generator_busy_s[g] += reply.busy_s
        late = []
        for rid, comp in reply.finished:
            entry = self.owner.pop(rid, None)
            if entry is not None:
                late.append(entry[1].add_segment(comp))
        return late

    def _drain_calls(self) -> list[Sample]:
        """Let the calls in flight return; the samples they finished (the env replies' episodes are closed by
        ``_close_episodes``)."""
        late = []
        for g, call in self.calls.items():
            late += self._late_finished(g, call.result())
        for _, _, call in self.env_calls:
            call.result()
        return late

    def _abort_requests(self) -> list[Sample]:
        """Abort every request still at a generator (and the aborts queued by redundancy or the watchdog); the
        samples that finished before their abort came. With partial rollout the aborted ones are carried."""
        by_gen: dict[int, list[str]] = {}
        for rid, (g, _) in self.owner.items():
            by_gen.setdefault(g, []).append(rid)
        for g in range(len(self.s.generators)):
            by_gen.setdefault(g, []).extend(self.aborts[g])
        calls = [(g, self.s.generators[g].submit([], ids)) for g, ids in by_gen.items() if ids]
        late = []
        for g, call in calls:
            reply = call.result()
            late += self._late_finished(g, reply)
            for rid, comp in reply.aborted:
                entry = self.owner.pop(rid, None)
                if entry is not None:
                    self._aborted(entry[1], comp)
        return late

    def _aborted(self, smp: Sample, comp: Completion) -> None:
        """A sample stopped by the batch's end: its tokens are discarded, or it waits to be resumed."""
        self.stats.samples_aborted += 1
        if not self.c.partial_rollout:
            self.stats.tokens_discarded += len(smp.response) + len(comp.token_ids)
        else:
            smp.finish_reason = "abort"
            self.s.carry_partials.append(smp.add_segment(comp))

    def _close_episodes(self) -> None:
        """Close every episode still open at an env rank: those cut by the batch end restart from their seed."""
        for ep_id, smp in self.episodes.items():
            self.to_close[smp.episode.env_rank].append(ep_id)
        self.episodes = {}
        for r, env in enumerate(self.s.envs):
            if self.to_close[r]:
                env.close(self.to_close[r]).result()
                self.to_close[r] = []

    def _carry_over(self, late: list[Sample]) -> None:
        """Partial rollout: score the samples that finished late, carry the groups still open, and buffer the
        complete ones the batch had no room for."""
        sched, stats = self.s, self.stats
        if late:
            sched.scorer.submit(late)
        for smp in sched.scorer.ready(wait=True):
            if (group := self.groups.get(smp.prompt.uid)) is not None:
                group.samples.append(smp)
                group.live -= 1
        for uid, group in self.groups.items():
            if group.live > 0:
                sched.carry[uid] = group  # its remaining samples are among carry_partials
                continue
            samples = sorted(group.samples, key=lambda x: x.index)
            if self._uniform(samples):
                stats.groups_dropped_uniform += 1
                stats.count(group.prompt.domain, "groups_dropped_uniform")
            else:
                sched.buffer.append(samples)
