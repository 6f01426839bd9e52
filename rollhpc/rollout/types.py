"""Records passed between the rollout phases (shapes in comments; token ids are plain ints)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from rollhpc.engines.completion import Completion


@dataclass(frozen=True)
class EpisodeSeed:
    """What a multi-turn prompt stands for: the env reset seed its group's episodes share."""

    seed: int


@dataclass(frozen=True)
class Prompt:
    uid: int  # unique over the run: identifies the group of samples drawn from this prompt
    tokens: tuple[int, ...]  # [P] prompt token ids
    example: object  # the task example (ground truth for the reward), passed on to the reward roles
    # response budget of this prompt (None: the scheduler's max_tokens)
    max_tokens: int | None = None
    # which reward roles score it, and its share of a batch (multi-domain RLVR)
    domain: str = "default"


@dataclass
class Sample:
    prompt: Prompt
    index: int  # position in its group, 0 .. group_size-1
    # [R] generated ids (EOS included when it stopped)
    response: list[int] = field(default_factory=list)
    # [R] sampled-token log-probs from the generator
    logprobs: list[float] = field(default_factory=list)
    # oldest policy version that produced any of its tokens (partial rollouts mix versions)
    version: int = -1
    finish_reason: str = ""  # "stop", "length" or "abort" (a partial waiting to be resumed)
    reward: float | None = None
    # what the reward was made of (rule, judge, ...)
    components: dict[str, float] = field(default_factory=dict)
    resumes: int = 0  # times it was aborted and continued (partial rollout)
    # multi-turn: the environment's side (None: a single-turn sample)
    episode: EpisodeState | None = None
    # int16 [fed, moe_layers, top_k]: the generator's routes of every token it fed, prompt included (its last
    # segment's: a resumed partial is prefilled again whole); None: none returned (routing replay r3 needs them)
    routes: np.ndarray | None = None

    @property
    def request_id(self) -> str:
        base = f"{self.prompt.uid}.{self.index}.{self.resumes}"
        return base if self.episode is None else f"{base}.t{len(self.episode.turn_ends)}"

    def add_segment(self, comp: Completion) -> Sample:
        """Add a generator segment; the sample's version is the oldest policy that wrote any of its tokens."""
        if comp.token_ids:
            self.version = comp.version if not self.response else min(self.version, comp.version)
        self.response += list(comp.token_ids)
        self.logprobs += list(comp.logprobs)
        self.finish_reason = comp.finish_reason
        # (a scripted generator's completions may carry none)
        routes = getattr(comp, "routes", None)
        if routes is not None:
            self.routes = routes
        return self

    @property
    def context(self) -> list[int]:
        """What the generator continues: the prompt (an episode's first observation) and the response so far."""
        prompt = self.prompt.tokens if self.episode is None else self.episode.prompt_ids
        return list(prompt) + self.response


@dataclass
class OpenGroup:
    """A prompt's group while its samples are still out; carried to the next collect with partial rollout."""

    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)  # finished (scored) samples
    live: int = 0  # samples still being reset, generated, stepped or scored


@dataclass
class EpisodeState:
    """A running multi-turn sample's environment side, as the scheduler keeps it. Its response is
    r1 || o2 || r2 || ...: generated tokens as generated, then each observation's token ids as the env role
    encoded them; ``generated`` marks which. The record of the finished episode, turn by turn, is
    ``rollout.episode.episode_of(sample)``.

    Shapes: R = len(sample.response); turns = len(turn_ends)."""

    id: str  # the env role's key of this episode ("uid.index")
    env_rank: int  # the env rank that hosts it
    # the generator that serves its turns (prefix cache); -1 until the first turn
    generator: int = -1
    # [P] instruction + first observation, encoded by the env role
    prompt_ids: list[int] = field(default_factory=list)
    # [R] 1 on generated tokens, 0 on observation tokens
    generated: list[int] = field(default_factory=list)
    # [turns] index in response of each turn's last generated token
    turn_ends: list[int] = field(default_factory=list)
    # [turns] the env's reward for each turn
    turn_rewards: list[float] = field(default_factory=list)
    # [turns] state_key of the state each turn acted in
    state_keys: list[Hashable] = field(default_factory=list)
    # [turns] the generator's finish_reason of each turn
    turn_finishes: list[str] = field(default_factory=list)
    # [turns] the text each turn gave the environment
    actions: list[str] = field(default_factory=list)
    # [turns] the environment's answer to each
    observations: list[str] = field(default_factory=list)
    instruction: str = ""
    observation: str = ""  # the first observation's text
    state_key: Hashable = None  # the state the next turn acts in (from the last reset or step)
    success: bool = False
    finish: str = ""  # "terminated", "truncated" (env or turn limit), "row_full", "abandoned", or the env role's reason
    tool_calls: int = 0
    env_step_s: float = 0.0  # summed over the episode's steps
    started: float = 0.0  # perf_counter at reset (the watchdog's clock)
    warned: bool = False
    # the env's info["metrics"], summed over steps
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def episode_return(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def turns_cut(self) -> int:
        """Turns that ran into their token budget (finish "length") instead of ending: a policy that stops ending
        its turns writes on past its action, and those tokens are trained on whatever the action earned."""
        return self.turn_finishes.count("length")


@dataclass
class RolloutStats:
    wall_s: float = 0.0
    # per generator: seconds inside engine steps
    generator_busy_s: list[float] = field(default_factory=list)
    groups_started: int = 0
    groups_dropped_uniform: int = 0  # dynamic sampling: all rewards equal, no learning signal
    groups_dropped_stale: int = 0  # async: produced by a policy older than the staleness bound
    groups_from_buffer: int = 0
    samples_aborted: int = 0
    samples_resumed: int = 0
    # tokens of finished samples (aborted partials not counted until they finish)
    tokens_generated: int = 0
    tokens_discarded: int = 0  # tokens of aborted samples thrown away (no partial rollout)
    # redundancy: samples stopped because their group was already full
    samples_aborted_redundant: int = 0
    episodes_started: int = 0
    # ended by the env, the turn limit or a full row (not aborted or abandoned)
    episodes_finished: int = 0
    episodes_succeeded: int = 0  # of those, the ones the env called a success
    # ended by the env role (error, timeout, invalid return) or a failed reset
    episodes_failed: int = 0
    episodes_abandoned: int = 0  # the watchdog gave up on them
    groups_dropped_abandoned: int = 0  # too few samples left to fill the group after abandons
    # episodes whose env reset failed (dropped like abandoned ones: no turn to learn from)
    resets_failed: int = 0
    # failed episodes by reason (its first word)
    failure_reasons: dict[str, int] = field(default_factory=dict)
    first_failure: str = ""  # the first failure's whole reason, for messages
    # per domain: groups started/dropped, tokens
    domains: dict[str, dict[str, int]] = field(default_factory=dict)
    # partial overlap: how long the generators sharing the trainer's GPUs waited
    generators_held_s: float = 0.0

    def count_reason(self, reason: str) -> None:
        key = reason.split(":")[0].split()[0] if reason.strip() else "unknown"
        self.failure_reasons[key] = self.failure_reasons.get(key, 0) + 1

    def count(self, domain: str, key: str, n: int = 1) -> None:
        d = self.domains.setdefault(
            domain, {"groups_started": 0, "groups_dropped_uniform": 0, "tokens_generated": 0}
        )
        d[key] = d.get(key, 0) + n

    @property
    def generator_idle_fraction(self) -> float:
        if not self.generator_busy_s or self.wall_s <= 0:
            return 0.0
        return 1.0 - sum(self.generator_busy_s) / (len(self.generator_busy_s) * self.wall_s)

    def as_metrics(self) -> dict[str, float]:
        return {
            "rollout_s": self.wall_s,
            "generator_idle_fraction": self.generator_idle_fraction,
            "groups_started": self.groups_started,
            "groups_dropped_uniform": self.groups_dropped_uniform,
            "groups_dropped_stale": self.groups_dropped_stale,
            "groups_from_buffer": self.groups_from_buffer,
            "samples_aborted": self.samples_aborted,
            "samples_resumed": self.samples_resumed,
            "tokens_generated": self.tokens_generated,
            "tokens_discarded": self.tokens_discarded,
            **(
                {"samples_aborted_redundant": self.samples_aborted_redundant}
                if self.samples_aborted_redundant
                else {}
            ),
            **({"generators_held_s": self.generators_held_s} if self.generators_held_s else {}),
            **(
                {
                    "episodes_started": self.episodes_started,
                    "episodes_failed": self.episodes_failed,
                    "episodes_abandoned": self.episodes_abandoned,
                    "resets_failed": self.resets_failed,
                    "groups_dropped_abandoned": self.groups_dropped_abandoned,
                    **{f"episodes_failed/{k}": v for k, v in sorted(self.failure_reasons.items())},
                }
                if self.episodes_started
                else {}
            ),
            **(
                {
                    f"{d}/{k}": v
                    for d, counts in sorted(self.domains.items())
                    for k, v in counts.items()
                }
                if len(self.domains) > 1 or set(self.domains) - {"default"}
                else {}
            ),
        }
