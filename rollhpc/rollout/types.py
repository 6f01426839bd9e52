"""Records passed between the rollout stages (shapes in comments; token ids are plain ints)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    uid: int  # unique over the run: identifies the group of samples drawn from this prompt
    tokens: tuple[int, ...]  # [P] prompt token ids
    example: Any  # the task example (ground truth for the reward)
    max_tokens: int | None = None  # response budget of this prompt (None: the scheduler's max_tokens)
    domain: str = "default"  # which reward roles score it, and its share of a batch (multi-domain RLVR)


@dataclass
class Sample:
    prompt: Prompt
    index: int  # position in its group, 0 .. group_size-1
    response: list[int] = field(default_factory=list)  # [R] generated ids (EOS included when it stopped)
    logprobs: list[float] = field(default_factory=list)  # [R] sampled-token log-probs from the generator
    version: int = -1  # oldest policy version that produced any of its tokens (partial rollouts mix versions)
    finish_reason: str = ""  # "stop", "length" or "abort" (a partial waiting to be resumed)
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)  # what the reward was made of (rule, judge, ...)
    resumes: int = 0  # times it was aborted and continued (partial rollout)

    @property
    def request_id(self) -> str:
        return f"{self.prompt.uid}.{self.index}.{self.resumes}"


@dataclass
class RolloutStats:
    wall_s: float = 0.0
    generator_busy_s: list[float] = field(default_factory=list)  # per generator: seconds inside engine steps
    groups_started: int = 0
    groups_dropped_uniform: int = 0  # dynamic sampling: all rewards equal, no learning signal
    groups_dropped_stale: int = 0  # async: produced by a policy older than the staleness bound
    groups_from_buffer: int = 0
    samples_aborted: int = 0
    samples_resumed: int = 0
    tokens_generated: int = 0  # tokens of finished samples (aborted partials not counted until they finish)
    tokens_discarded: int = 0  # tokens of aborted samples thrown away (no partial rollout)
    domains: dict[str, dict[str, int]] = field(default_factory=dict)  # per domain: groups started/dropped, tokens

    def count(self, domain: str, key: str, n: int = 1) -> None:
        d = self.domains.setdefault(domain, {"groups_started": 0, "groups_dropped_uniform": 0, "tokens_generated": 0})
        d[key] = d.get(key, 0) + n

    @property
    def generator_idle_fraction(self) -> float:
        if not self.generator_busy_s or self.wall_s <= 0:
            return 0.0
        return 1.0 - sum(self.generator_busy_s) / (len(self.generator_busy_s) * self.wall_s)

    def as_metrics(self) -> dict[str, float]:
        return {"rollout_s": self.wall_s, "generator_idle_fraction": self.generator_idle_fraction,
                "groups_started": self.groups_started, "groups_dropped_uniform": self.groups_dropped_uniform,
                "groups_dropped_stale": self.groups_dropped_stale, "groups_from_buffer": self.groups_from_buffer,
                "samples_aborted": self.samples_aborted, "samples_resumed": self.samples_resumed,
                "tokens_generated": self.tokens_generated, "tokens_discarded": self.tokens_discarded,
                **({f"{d}/{k}": v for d, counts in sorted(self.domains.items()) for k, v in counts.items()}
                   if len(self.domains) > 1 or set(self.domains) - {"default"} else {})}
