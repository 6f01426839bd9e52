"""Several tasks as one, each example tagged with its domain: the data of multi-domain RLVR.

Why a task: the SFT warm start, the recorded splits and the held-out set all work on "a task", so a mixture
that is itself a task gets them for free: ``prepare_policy(task="mixture", task_options={"domains": ...})``
fine-tunes one policy on every domain, and the RL pipeline reads the same splits back and routes each
example to its domain's reward roles. Each domain's split is its own task's ``make_splits`` (its own
disjointness guarantee), with a seed derived from the mixture's seed and the domain's name, and a share of
the example counts.

    domains = {"math": {"task": "arithmetic", "options": {"digits": 2}, "share": 0.5},
               "code": {"task": "pyfunc", "share": 0.5}}
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rollhpc.tasks import task_module


@dataclass(frozen=True)
class DomainExample:
    domain: str  # the name the pipeline's domains use
    task: str  # the task module that made ``inner`` (and scores it)
    inner: object  # the task's own example (only its task module reads it)

    @property
    def prompt(self) -> str:
        return task_module(self.task).format_prompt(self.inner)

    def chat(self) -> list[dict[str, str]]:
        """The inner example's conversation when it has one (file datasets), else the prompt as the user turn."""
        chat = getattr(self.inner, "chat", None)
        return chat() if callable(chat) else [{"role": "user", "content": self.prompt}]


def _seed(seed: int, domain: str) -> int:
    return seed ^ int.from_bytes(hashlib.sha256(domain.encode()).digest()[:4], "little")


def _options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in (options or {}).items()}


def check_domains(domains: dict[str, Any]) -> None:
    """Each domain names a task and a share; shares sum to 1."""
    if not domains:
        raise ValueError("a mixture needs at least one domain")
    for name, d in domains.items():
        unknown = set(d) - {"task", "options", "share"}
        if unknown or "task" not in d:
            raise ValueError(
                f"domain {name!r}: needs 'task' (and may have 'options', 'share'); got {sorted(d)}"
            )
        task_module(d["task"])
    total = sum(float(d.get("share", 1.0 / len(domains))) for d in domains.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(
            f"domain shares sum to {total:g}, not 1: { ({n: d.get('share') for n, d in domains.items()}) }"
        )


def counts(n: int, domains: dict[str, Any]) -> dict[str, int]:
    """``n`` split by share (largest remainders get the rounding), every domain at least 1."""
    shares = {k: float(d.get("share", 1.0 / len(domains))) for k, d in domains.items()}
    raw = {k: n * s for k, s in shares.items()}
    out = {k: max(1, int(v)) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - int(raw[k]), reverse=True)[
        : max(0, n - sum(out.values()))
    ]:
        out[k] += 1
    return out


def make_splits(
    seed: int, n_train: int, n_heldout: int, domains: dict[str, Any] | None = None
) -> tuple[list[DomainExample], list[DomainExample]]:
    domains = domains or {}
    check_domains(domains)
    n_tr, n_ho = counts(n_train, domains), counts(n_heldout, domains)
    train: list[DomainExample] = []
    heldout: list[DomainExample] = []
    for name, d in domains.items():
        tr, ho = task_module(d["task"]).make_splits(
            _seed(seed, name), n_tr[name], n_ho[name], **_options(d.get("options", {}))
        )
        train += [DomainExample(name, d["task"], e) for e in tr]
        heldout += [DomainExample(name, d["task"], e) for e in ho]
    # interleaved, so that any prefix has every domain in its share (the SFT monitors a prefix, a run may
    # evaluate on the first n_heldout)
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(heldout)
    return train, heldout


def format_prompt(example: DomainExample) -> str:
    return example.prompt


def completion(example: DomainExample) -> str:
    return task_module(example.task).completion(example.inner)


def score(example: DomainExample, text: str) -> float:
    return float(task_module(example.task).score(example.inner, text))


def corpus(examples: Iterable[DomainExample]) -> Iterator[str]:
    by_task: dict[str, list[object]] = {}
    for e in examples:
        by_task.setdefault(e.task, []).append(e.inner)
    for task, inner in by_task.items():
        yield from task_module(task).corpus(inner)
