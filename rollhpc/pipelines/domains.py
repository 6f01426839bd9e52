"""Multi-domain RLVR for the RLVR pipeline: domains, their reward roles, batch shares, normalisation, metrics.

ROLL trains one policy on math, code and general data at once; each domain is scored by its own reward
worker(s) and has its own share of every batch. Here a domain names its task, its reward roles (config roles,
so each is placed, planned and scaled like any role: ``rollhpc plan`` shows them), the weights of the reward
components those roles return (rule + judge + format penalty), its batch share (``share``: the probability
that the next prompt comes from it, ROLL's interleave probabilities), and optionally its own dynamic
sampling. Rewards are normalised per domain (a code test fraction and a judge score do not share a scale),
and metrics say per domain what happened (reward, its components, held-out accuracy, tokens, dropped groups).

The data is the ``mixture`` task (``rollhpc.tasks.mixture``): the SFT warm start and the held-out split are
built from the same domains, and each example keeps its domain.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollhpc.algo.reward_norm import RewardNormalizer, RewardNormConfig
from rollhpc.rollout.ports import RewardPort
from rollhpc.rollout.scoring import DomainScoring
from rollhpc.rollout.types import Prompt, Sample
from rollhpc.tasks import task_module
from rollhpc.tasks.mixture import DomainExample


@dataclass(kw_only=True)
class DomainConfig:
    task: str  # a task module (rollhpc.tasks.NAME or an import path)
    options: dict[str, Any] = field(default_factory=dict)  # the task's make_splits keywords
    share: float  # of every batch's prompts (shares of all domains sum to 1)
    # reward roles that score it (all of them)
    rewards: list[str] = field(default_factory=lambda: ["reward"])
    # reward component -> weight (absent: 1)
    weights: dict[str, float] = field(default_factory=dict)
    dynamic_sampling: bool | None = None  # None: rollout.dynamic_sampling
    accuracy: str | None = None  # the component held-out accuracy reads (None: the combined reward)

    def __post_init__(self) -> None:
        # tasks over files validate them at load
        check = getattr(task_module(self.task), "check_options", None)
        if check is not None:
            self.options = check(dict(self.options))
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be in (0, 1], got {self.share}")
        if not self.rewards:
            raise ValueError("rewards: a domain needs at least one reward role")


def check_domains(domains: Mapping[str, DomainConfig], roles: Mapping[str, object]) -> None:
    """At config load: shares sum to 1, every reward role exists. One message each, before anything starts."""
    if not domains:
        return
    total = sum(d.share for d in domains.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(
            f"domains: the shares sum to {total:g}, not 1 "
            f"({', '.join(f'{n}={d.share:g}' for n, d in domains.items())})"
        )
    for name, d in domains.items():
        missing = [r for r in d.rewards if r not in roles]
        if missing:
            raise ValueError(
                f"domains.{name}.rewards: no role named {', '.join(map(repr, missing))} "
                f"(roles: {', '.join(sorted(roles))}); add it under roles: or fix the name"
            )
        if d.accuracy is not None and d.accuracy in d.weights and d.weights[d.accuracy] == 0:
            raise ValueError(f"domains.{name}.accuracy: component {d.accuracy!r} has weight 0")


def mixture_options(domains: Mapping[str, DomainConfig]) -> dict[str, Any]:
    """The ``mixture`` task's options for these domains (what the warm start is fine-tuned on)."""
    return {
        "domains": {
            n: {"task": d.task, "options": dict(d.options), "share": d.share}
            for n, d in domains.items()
        }
    }


def scoring(
    domains: Mapping[str, DomainConfig], ports: Mapping[str, list[RewardPort]]
) -> dict[str, DomainScoring]:
    """The scheduler's view: per domain, its reward roles' rank ports and the component weights."""
    return {
        n: DomainScoring({r: ports[r] for r in d.rewards}, dict(d.weights), d.dynamic_sampling)
        for n, d in domains.items()
    }


class MixedPromptStream:
    """Prompts drawn from the domains by share (seeded); within a domain an endless reshuffled pass over its
    training examples. Its position is part of a run checkpoint (exact resume)."""

    def __init__(
        self,
        examples: list[DomainExample],
        shares: Mapping[str, float],
        encode: Callable[[DomainExample], list[int]],
        seed: int,
    ):
        self.encode = encode
        self.shares = dict(shares)
        self.pools: dict[str, list[DomainExample]] = {
            d: [e for e in examples if e.domain == d] for d in self.shares
        }
        empty = [d for d, pool in self.pools.items() if not pool]
        if empty:
            raise ValueError(f"no training examples for domain(s) {', '.join(empty)}")
        self._rng = random.Random(seed)
        self._order: dict[str, list[int]] = {d: [] for d in self.shares}
        self._pos: dict[str, int] = {d: 0 for d in self.shares}
        self.drawn = 0

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        x, domain = self._rng.random(), None
        for domain, share in self.shares.items():
            x -= share
            if x < 0:
                break
        pool = self.pools[domain]
        if self._pos[domain] >= len(self._order[domain]):
            self._order[domain] = list(range(len(pool)))
            self._rng.shuffle(self._order[domain])
            self._pos[domain] = 0
        ex = pool[self._order[domain][self._pos[domain]]]
        self._pos[domain] += 1
        self.drawn += 1
        return Prompt(self.drawn - 1, tuple(self.encode(ex)), ex.inner, domain=domain)

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self._rng.getstate(),
            "order": {d: list(o) for d, o in self._order.items()},
            "pos": dict(self._pos),
            "drawn": self.drawn,
            "n_examples": {d: len(p) for d, p in self.pools.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("n_examples") != {d: len(p) for d, p in self.pools.items()}:
            raise ValueError(
                f"the checkpoint's prompt stream ran over {state.get('n_examples')} training examples "
                "per domain, this run has other counts: resume with the domains it was saved with"
            )
        self._rng.setstate(state["rng"])
        self._order = {d: list(o) for d, o in state["order"].items()}
        self._pos, self.drawn = dict(state["pos"]), state["drawn"]


class DomainNormalizers:
    """One reward normaliser per domain (``reward_norm`` settings, separate running moments)."""

    def __init__(self, config: RewardNormConfig, domains: list[str]):
        self.norms = {d: RewardNormalizer(config) for d in domains}

    def __call__(self, groups: list[list[Sample]]) -> np.ndarray:
        """[groups, group_size] rewards, each row normalised by its domain's normaliser."""
        rewards = np.array([[s.reward for s in g] for g in groups], dtype=np.float64)
        out = np.empty_like(rewards)
        for d, norm in self.norms.items():
            rows = [i for i, g in enumerate(groups) if g[0].prompt.domain == d]
            if rows:
                out[rows] = norm(rewards[rows])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {d: n.state_dict() for d, n in self.norms.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for d, n in self.norms.items():
            n.load_state_dict(state[d])


def sample_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per domain: mean reward, mean of each component, mean response length and sample count."""
    out: dict[str, float] = {}
    by_domain: dict[str, list[Sample]] = {}
    for s in samples:
        by_domain.setdefault(s.prompt.domain, []).append(s)
    for d, ss in sorted(by_domain.items()):
        out[f"{d}/reward_mean"] = float(np.mean([s.reward for s in ss]))
        out[f"{d}/samples"] = len(ss)
        out[f"{d}/response_len_mean"] = float(np.mean([len(s.response) for s in ss]))
        for c in sorted({c for s in ss for c in s.components}):
            out[f"{d}/reward/{c}"] = float(np.mean([s.components.get(c, 0.0) for s in ss]))
    return out
