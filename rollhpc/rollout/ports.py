"""The rollout scheduler's ports and the messages that pass through them (shapes in comments; ids are plain ints).

Why typed messages: a request or reply crosses a process boundary (controller to generator or env rank) and
two layers (the scheduler in ``rollout/``, the roles in ``workers/``); as dicts their fields were named in the
docstrings of both sides and checked by neither, so a renamed key failed far from where it was written.
Here each field is declared once, with its meaning and default, and a misspelt one fails where it is made.

The ports themselves are protocols: in a run they are a worker rank's remote methods, called through the
controller (``RankProxy``: a generator's ``rollout``, a reward rank's ``score``; ``pipelines.agentic``'s
``_EnvRank``), in a test or benchmark an engine or an ``EnvWorker`` called in the caller's thread (wrap the
reply in ``Done``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from rollhpc.engines.completion import Completion

__all__ = [
    "Pending",
    "Done",
    "GenerationRequest",
    "GenerationReply",
    "GeneratorPort",
    "RewardPort",
    "ResetRequest",
    "ResetReply",
    "StepRequest",
    "StepReply",
    "EnvPort",
]


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# a reward role's score of one item: a float, or named components
Reward = float | Mapping[str, float]


class Pending(Protocol[T_co]):
    def done(self) -> bool: ...
    def result(self) -> T_co: ...


class Done(Generic[T]):
    """An already finished call (for ports that run in the caller's thread)."""

    def __init__(self, value: T):
        self.value = value

    def done(self) -> bool:
        return True

    def result(self) -> T:
        return self.value


# ---------------------------------------------------------------------------------------------------- generation
@dataclass(frozen=True)
class GenerationRequest:
    """One sample's next stretch of generation (a single-turn response, or an episode's next turn)."""

    id: str  # the scheduler's request id (``Sample.request_id``): unique among requests in flight
    prompt: list[int]  # [P] the context to continue (prompt, and an episode's row so far)
    max_tokens: int  # most tokens to generate
    seed: int | None = None  # sampling seed (None: unseeded)
    temperature: float | None = None  # None: the generate role's own; 0: greedy (evaluation)


@dataclass
class GenerationReply:
    """What a generator finished and aborted since its last call.

    Completions have ``token_ids`` [R], ``logprobs`` [R], ``finish_reason`` and ``version`` (the policy that
    generated them); an aborted request's completion holds the tokens it had when it was stopped.
    """

    finished: list[tuple[str, Completion]] = field(default_factory=list)  # (request id, completion)
    # (request id, partial completion)
    aborted: list[tuple[str, Completion]] = field(default_factory=list)
    busy_s: float = 0.0  # seconds inside engine steps since the last call (the rest was idle)


class GeneratorPort(Protocol):
    def submit(self, adds: list[GenerationRequest], aborts: list[str]) -> Pending[GenerationReply]:
        """Add requests, abort ids, and step the engine until a request finishes; the result is a
        ``GenerationReply``."""
        ...


class RewardPort(Protocol):
    def submit(self, items: list[tuple[object, list[int]]]) -> Pending[list[Reward]]:
        """Score ``(example, response token ids)`` pairs; the result has one float, or one dict of named
        reward components, per pair."""
        ...


# ---------------------------------------------------------------------------------------------------- episodes
@dataclass(frozen=True)
class ResetRequest:
    episode: (
        str  # the scheduler's episode id ("uid.index"); the env rank holds the episode under it
    )
    seed: int  # the environment's reset seed


@dataclass
class ResetReply:
    """A started episode, or why it could not start (``ended``; the env rank then does not hold it)."""

    episode: str
    rank: int = -1  # the env rank that holds it
    # [P] the formatted instruction and first observation
    prompt_ids: list[int] = field(default_factory=list)
    instruction: str = ""
    observation: str = ""  # the first observation's text
    state_key: Hashable = None  # the state the first turn acts from (GiGPO's anchor)
    info: dict[str, object] = field(default_factory=dict)  # the environment's reset info
    ended: str | None = None  # None, or "timeout", "error: ...", "invalid: ..."
    reset_s: float = 0.0


@dataclass(frozen=True)
class StepRequest:
    episode: str
    response_ids: list[int]  # [R] the turn's generated ids, as generated
    # whether the response ended its turn (None: it ends with the stop token)
    stopped: bool | None = None


@dataclass
class StepReply:
    """The environment's answer to one turn. ``ended`` is None while the episode goes on, else why it is over:
    ``terminated`` / ``truncated`` (the environment's own flags) or a fault that dropped the environment
    (``timeout``, ``error: <Type: message>``, ``invalid: <what>``: reward 0, truncated True)."""

    episode: str
    # [O] the formatted next observation; empty once it is over
    obs_ids: list[int] = field(default_factory=list)
    observation: str = ""  # the next observation's text
    # the text the environment was given (the turn formatter's reading of the response)
    action: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = True
    success: bool | None = None  # the environment's info["success"], when it says
    state_key: Hashable = None  # the state the next turn acts from
    # the environment's info["metrics"] of this step
    metrics: dict[str, float] = field(default_factory=dict)
    use_tool: bool = False
    ended: str | None = None
    step_s: float = 0.0


class EnvPort(Protocol):
    """One env rank (``rollhpc.workers.env.EnvWorker``): episodes keyed by id live there between calls."""

    def reset(self, items: list[ResetRequest]) -> Pending[list[ResetReply]]:
        """One ``ResetReply`` per request, in order."""
        ...

    def step(self, items: list[StepRequest]) -> Pending[list[StepReply]]:
        """One ``StepReply`` per request, in order."""
        ...

    def close(self, ids: list[str]) -> Pending[object]:
        """Forget these episodes (aborted or abandoned)."""
        ...
