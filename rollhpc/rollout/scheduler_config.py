"""``SchedulerConfig``: the rollout scheduler's settings (``pipeline.options.rollout``), checked when made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SchedulerConfig:
    group_size: int = 8
    max_tokens: int = 64  # response tokens per sample (per turn, for an episode)
    max_inflight_per_generator: int = 64  # requests a generator holds at once (its batch)
    oversample: float = 0.5  # start up to (1 + oversample) x the groups still needed
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal and start new ones
    # stop starting groups after this many in one collect (0: 8 x n_groups)
    max_groups_per_batch: int = 0
    # keep aborted partials and resume them in the next collect (single-turn)
    partial_rollout: bool = False
    # policy versions a group may lag behind the current one (0: on-policy only)
    max_staleness: int = 0
    redundancy: int = 0  # extra samples started per group; the first group_size to finish are kept
    # an episode's row (prompt + every turn) may not exceed this (0: no limit)
    max_model_len: int = 0
    # an episode is cut ("truncated") after this many turns (0: only the env's own limit)
    max_turns: int = 0
    warn_after_s: float = 0.0  # log a sample still alive after this long (0: never)
    abandon_after_s: float = 0.0  # abandon a sample still alive after this long (0: never)
    poll_interval_s: float = 0.0005

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_tokens < 1 or self.max_inflight_per_generator < 1:
            raise ValueError("group_size, max_tokens and max_inflight_per_generator must be >= 1")
        if (
            self.oversample < 0
            or self.max_staleness < 0
            or self.redundancy < 0
            or self.max_model_len < 0
            or self.max_turns < 0
        ):
            raise ValueError(
                "oversample, max_staleness, redundancy, max_model_len and max_turns must be >= 0"
            )
        if self.warn_after_s < 0 or self.abandon_after_s < 0:
            raise ValueError("warn_after_s and abandon_after_s must be >= 0 (0: off)")
        if self.partial_rollout and self.redundancy:
            raise ValueError(
                "partial_rollout keeps a group's aborted samples, redundancy aborts the surplus for "
                "good: use one of them"
            )

    @property
    def samples_per_group(self) -> int:
        return self.group_size + self.redundancy
