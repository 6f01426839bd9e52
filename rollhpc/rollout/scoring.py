"""Scoring a sample by its domain's reward roles: one call per role, components merged, one weighted reward.

Why a module of its own: ROLL scores mixed data (math, code, general) with a reward worker per domain, and a
sample's reward may combine several verifiers (a rule, a judge, a format penalty). The scheduler should not
care which: it hands finished samples to ``Scorer.submit`` and later collects ``(sample, reward,
components)``. A role's reply per item is a float (one component, named after the role) or a dict of named
components; the reward is their weighted sum (weight 1 unless the domain says otherwise). Every component is
kept on the sample, so metrics and the rollouts file show what the reward was made of.

Pure logic, like the scheduler: ports are anything with ``submit(items) -> Pending``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from rollhpc.rewards.components import combine
from rollhpc.rollout.ports import Pending, Reward, RewardPort
from rollhpc.rollout.types import Sample

DEFAULT_DOMAIN = "default"


@dataclass
class DomainScoring:
    """How one domain's samples are scored: its reward roles (each a list of rank ports, used round-robin)
    and the weights of the components they return."""

    roles: dict[str, list[RewardPort]]  # role name -> ports of its ranks
    weights: dict[str, float] = field(default_factory=dict)  # component -> weight (absent: 1.0)
    dynamic_sampling: bool | None = None  # None: the scheduler's setting

    def __post_init__(self) -> None:
        if not self.roles or any(not ports for ports in self.roles.values()):
            raise ValueError("a domain needs at least one reward role with at least one rank")


def components_of(role: str, value: Reward) -> dict[str, float]:
    """A role's reply for one item as named components."""
    if isinstance(value, Mapping):
        return {str(k): float(v) for k, v in value.items()}
    return {role: float(value)}


def item_components(replies: Mapping[str, list[Reward]], i: int) -> dict[str, float]:
    """Item ``i``'s components from every role's reply ({role: one value per item})."""
    components: dict[str, float] = {}
    for role, values in replies.items():
        components.update(components_of(role, values[i]))
    return components


class _Job:
    """One batch of one domain's samples, out to each of the domain's reward roles."""

    def __init__(self, domain: str, samples: list[Sample], calls: dict[str, Pending[list[Reward]]]):
        self.domain, self.samples, self.calls = domain, samples, calls

    def done(self) -> bool:
        return all(c.done() for c in self.calls.values())


class Scorer:
    """Sends finished samples to their domain's reward roles and gives them back scored."""

    def __init__(self, domains: Mapping[str, DomainScoring]):
        if not domains:
            raise ValueError("the scheduler needs at least one reward worker")
        self.domains = dict(domains)
        # "domain/role" -> calls so far (round-robin over the role's ranks)
        self.turn: dict[str, int] = {}
        self.jobs: list[_Job] = []

    @classmethod
    def of(cls, rewards: list[RewardPort] | Mapping[str, DomainScoring]) -> Scorer:
        """From the scheduler's ``rewards``: a list of ports (one domain, one role) or {domain: DomainScoring}."""
        if isinstance(rewards, Mapping):
            return cls(rewards)
        if not rewards:
            raise ValueError("the scheduler needs at least one generator and one reward worker")
        return cls({DEFAULT_DOMAIN: DomainScoring({"reward": list(rewards)})})

    def dynamic_sampling(self, domain: str, default: bool) -> bool:
        d = self.domains.get(domain)
        return default if d is None or d.dynamic_sampling is None else d.dynamic_sampling

    def submit(self, samples: list[Sample]) -> None:
        by_domain: dict[str, list[Sample]] = {}
        for s in samples:
            by_domain.setdefault(s.prompt.domain, []).append(s)
        for domain, group in by_domain.items():
            scoring = self.domains.get(domain)
            if scoring is None:
                raise ValueError(
                    f"a prompt of domain {domain!r}, which has no reward roles "
                    f"(domains: {sorted(self.domains)})"
                )
            items = [(s.prompt.example, s.response) for s in group]
            calls = {}
            for role, ports in scoring.roles.items():
                key = f"{domain}/{role}"
                n = self.turn.get(key, 0)
                self.turn[key] = n + 1
                calls[role] = ports[n % len(ports)].submit(items)
            self.jobs.append(_Job(domain, group, calls))

    def busy(self) -> bool:
        return bool(self.jobs)

    def ready(self, wait: bool = False) -> list[Sample]:
        """Samples whose every role has replied, with ``reward`` and ``components`` set (all, with ``wait``)."""
        out = []
        for job in list(self.jobs):
            if not wait and not job.done():
                continue
            self.jobs.remove(job)
            replies = {role: call.result() for role, call in job.calls.items()}
            weights = self.domains[job.domain].weights
            for i, s in enumerate(job.samples):
                s.components = item_components(replies, i)
                s.reward = combine(s.components, weights)
                out.append(s)
        return out

    def state_dict(self) -> dict[str, int]:
        return dict(self.turn)

    def load_state_dict(self, state: Mapping[str, int] | int) -> None:
        # an int: a checkpoint's one counter, of a run with one domain and one reward role
        if isinstance(state, int):
            state = {f"{DEFAULT_DOMAIN}/reward": state}
        self.turn = {str(k): int(v) for k, v in state.items()}
