"""Environment role: hosts the text environments of multi-turn episodes, steps them in batches under a
time limit, and tokenizes what the policy reads next.

The controller's scheduler keys every episode to one env rank; that rank keeps the environment between
calls, so only token ids travel: ``reset`` answers with the encoded prompt (instruction and first
observation through the turn formatter), ``step`` takes the generated ids, decodes them, hands the action
to the environment, and answers with the encoded next observation. Observations are tokenized here, never
on the controller, and generated tokens are never re-encoded (the row grows by concatenation only).

Why one process per episode. An environment is code we do not control (a game, a tool, a parser of the
policy's text), and the issue asks that one which raises, hangs or returns garbage ends its own episode,
never the run. Raising and garbage can be caught anywhere; hanging cannot be undone in a thread: a
Python thread cannot be killed, a busy loop keeps taking the GIL from the rest of the rank for ever, and a
hang inside C code that holds the GIL (a catastrophic regular expression over the policy's text is enough)
freezes every thread of the process, including the one that was meant to enforce the limit. So each
episode's environment lives in its own small process, and the rank only waits on sockets:

- a *host* process (``rollhpc.envs.host``, started fresh with ``python -P -m rollhpc.envs.host``, so it inherits neither MPI nor
  the rank's threads) imports the environment class once and forks one child per episode on request
  (copy-on-write: a child costs a fork, ~1 ms, and the pages it writes, a few MB);
- the rank sends each child its command (``reset`` with the seed, ``step`` with the action text) and waits
  for the replies of a batch together (``selectors``), at most ``workers`` in flight at once (one per CPU
  this rank may use), each with its own deadline from the moment it was sent;
- a child that misses its deadline is SIGKILLed by the host (which alone reaps its children, so a pid is
  never reused under us) and its episode ends with ``timeout``; its CPU and memory come back at once, and
  it has held one of the ``workers`` slots for ``step_timeout_s``: that is all a hung env costs. A child
  that dies on its own (a segfault, ``os._exit``) ends its episode with an ``error``.
- the child checks what the environment returned (a 5-tuple, a str observation, a finite reward, bool
  flags, a dict info with a hashable ``state_key`` and numeric ``metrics``) and answers ``invalid: <what>``
  otherwise; the rank then tells it to close the environment (under the same time limit, by ``SIGALRM``)
  and exit. A dropped environment is never stepped again.

Nothing is left running: ``close`` ends every child and the host, and the host SIGKILLs its children if
the rank vanishes (its control socket reads end-of-file) while the children die with the host
(``PR_SET_PDEATHSIG``). Environment processes run single-threaded numerical libraries (OMP, OpenBLAS and
MKL thread counts set to 1): parallelism comes from the number of processes. What it costs: a live episode
is one idle process (the pages it writes, a few MB) and one socket here, and each call a round trip over
a local socket (tens of microseconds). What it is not: a sandbox. The processes run as the rank's user
with its files and network; an environment that executes the policy's code runs it in ``rollhpc.sandbox``.

Remote methods (per rank, through ``group.at(rank)``; the scheduler keys episodes to ranks):
``reset`` (a group call spreads new episodes over the ranks; each reply says which ``rank`` holds it),
``step``, ``close_episodes`` (idempotent), ``metrics``. An episode id the rank does not hold in ``step``,
or one reset twice, is the caller's bug and raises.
"""

from __future__ import annotations

import inspect
import logging
import os
import resource
import selectors
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollhpc.envs import env_class
from rollhpc.envs.host import EnvHost, EpisodeConnection, is_finite
from rollhpc.protocol.worker import Dispatch, Worker, WorkerContext, register
from rollhpc.rollout.ports import ResetReply, ResetRequest, StepReply, StepRequest
from rollhpc.rollout.turns import ChatTemplateTurns, PlainTextTurns, TurnFormatter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["EnvWorker", "EnvCounters"]

log = logging.getLogger(__name__)

FAULTS = ("timeout", "error", "invalid")  # reasons an environment's fault ends its episode with


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # a Slurm allocation's cores, not the node's
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------------------
# The role.


@dataclass
class _EpisodeProcess:
    """The process that holds one episode's environment, and the socket to it."""

    id: str
    pid: int
    conn: EpisodeConnection


@dataclass
class EnvCounters:
    """Since the role started: episodes started and how they ended, steps and their wall time."""

    started: int = 0
    # reason kind (terminated, timeout, ...) -> episodes
    ended: Counter = field(default_factory=Counter)
    steps: int = 0  # env steps that returned a valid result
    step_s: float = 0.0  # summed over those steps
    resets: int = 0  # resets that returned a valid result
    reset_s: float = 0.0

    def end(self, reason: str) -> int:
        kind = reason.split(":", 1)[0]
        self.ended[kind] += 1
        return self.ended[kind]

    def as_dict(self, live: int) -> dict[str, float]:
        out = {
            "env_episodes_started": self.started,
            "env_episodes_live": live,
            "env_episodes_ended": sum(self.ended.values()),
            "env_steps": self.steps,
            "env_step_s_mean": round(self.step_s / self.steps, 6) if self.steps else 0.0,
            "env_reset_s_mean": round(self.reset_s / self.resets, 6) if self.resets else 0.0,
            "env_timeouts": self.ended["timeout"],
            "env_errors": self.ended["error"],
            "env_invalid": self.ended["invalid"],
        }
        for kind in ("terminated", "truncated", "closed"):
            out[f"env_ended_{kind}"] = self.ended[kind]
        return out


class EnvWorker(Worker):
    @dataclass(kw_only=True)
    class Options:
        env: str  # a shipped environment's short name or package.module:Class (rollhpc.envs)
        model_dir: str  # where the tokenizer is (the policy checkpoint)
        # the environment's constructor keywords
        env_options: dict[str, Any] = field(default_factory=dict)
        # turn formatter: "plain" (PlainTextTurns) or "chat" (ChatTemplateTurns)
        turns: str = "plain"
        system: str | None = None  # the system prompt of chat turns
        # chat turns: the token that ends an assistant turn (None: the tokenizer's)
        eos_token: str | None = None
        # per env step (and per env close): past it the episode ends "timeout"
        step_timeout_s: float = 10.0
        reset_timeout_s: float = 30.0  # per reset, building the environment included
        workers: int | None = None  # env calls at once; None: the CPUs this rank may use

        def __post_init__(self) -> None:
            # an unknown or broken environment stops the run at load, with the list
            cls = env_class(self.env)
            if not isinstance(self.env_options, dict):
                raise ValueError(f"env_options must be a mapping, got {self.env_options!r}")
            try:  # options the constructor does not take stop the run at load too, not at every reset
                inspect.signature(cls).bind(**self.env_options)
            except TypeError as e:
                raise ValueError(
                    f"environment {self.env!r} does not take env_options "
                    f"{sorted(self.env_options)}: {e}"
                ) from None
            if self.turns not in ("plain", "chat"):
                raise ValueError(f"turns must be 'plain' or 'chat', got {self.turns!r}")
            for name in ("system", "eos_token"):
                if getattr(self, name) is not None and self.turns != "chat":
                    raise ValueError(
                        f"{name} needs turns: chat (plain turns have no system message or end of turn)"
                    )
            for name in ("step_timeout_s", "reset_timeout_s"):
                value = getattr(self, name)
                if not is_finite(value) or value <= 0:
                    raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
            if self.workers is not None and self.workers < 1:
                raise ValueError(f"workers must be >= 1 (or None: one per CPU), got {self.workers}")

    def __init__(self, ctx: WorkerContext, options: Options):
        super().__init__(ctx, options)
        _raise_open_files_limit()
        self.workers = options.workers or _cpus()
        # The host first: it is started before the tokenizer spins up threads in this process.
        self.host = EnvHost(options.env, options.env_options, options.step_timeout_s)
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
            self.formatter = _formatter(
                options.turns, self.tokenizer, options.system, options.eos_token
            )
        except BaseException:
            self.host.stop(0.0)
            raise
        # Chat templates write their own special tokens into the text; a plain prompt gets the tokenizer's
        # (a BOS where the model has one), like the single-turn pipelines' prompts. Continuations get none.
        self.prompt_special_tokens = options.turns == "plain"
        # Whether the response ended with the stop token changes what closes the turn in a chat template
        # (``next(observation, stopped=...)``); a formatter without that parameter does not care.
        self.stop_id = getattr(self.formatter, "eos_id", self.tokenizer.eos_token_id)
        self.next_takes_stopped = "stopped" in inspect.signature(self.formatter.next).parameters
        self.episodes: dict[str, _EpisodeProcess] = {}
        self.counters = EnvCounters()
        log.info(
            "env role %s: %s, %d env calls at once, step limit %.1f s",
            ctx.role,
            options.env,
            self.workers,
            options.step_timeout_s,
        )

    @register(Dispatch.DP_SPLIT)
    def reset(self, items: list[ResetRequest]) -> list[ResetReply]:
        """Start episodes: one ``ResetReply`` per request, in order. ``prompt_ids`` encode
        ``formatter.first(instruction, observation)``; ``ended`` is None, or the reason the reset failed
        (``timeout``, ``error: ...``, ``invalid: ...``; the episode is then not held)."""
        ids = [str(it.episode) for it in items]
        again = sorted(
            {i for i in ids if i in self.episodes} | {i for i, c in Counter(ids).items() if c > 1}
        )
        if again:
            raise ValueError(f"reset: episode ids already held or repeated: {again[:10]}")
        self.counters.started += len(items)
        replies = [ResetReply(i, rank=self.ctx.group_rank) for i in ids]
        jobs: list[tuple[int, _EpisodeProcess, tuple]] = []
        for k, made in enumerate(self.host.fork(len(items))):
            if isinstance(made, str):
                self._ended(replies[k], made)
            else:
                jobs.append(
                    (
                        k,
                        _EpisodeProcess(ids[k], made[0], EpisodeConnection(made[1])),
                        ("reset", int(items[k].seed)),
                    )
                )
        texts: dict[int, str] = {}
        for (k, ep, _), (status, payload, secs) in zip(
            jobs, self._exchange(jobs, self.options.reset_timeout_s)
        ):
            reply = replies[k]
            reply.reset_s = round(secs, 6)
            if status == "ok":
                self.episodes[ep.id] = ep
                self.counters.resets += 1
                self.counters.reset_s += secs
                texts[k] = self.formatter.first(payload["instruction"], payload["observation"])
                reply.instruction, reply.observation = (
                    payload["instruction"],
                    payload["observation"],
                )
                reply.state_key, reply.info = payload["state_key"], payload["info"]
            else:
                self._drop(ep, status)
                self._ended(reply, _reason(status, payload))
        for k, ids_ in zip(texts, self._encode(list(texts.values()), self.prompt_special_tokens)):
            replies[k].prompt_ids = ids_
        return replies

    @register(Dispatch.ONE_TO_ALL)
    def step(self, items: list[StepRequest]) -> list[StepReply]:
        """Step episodes this rank holds (call it through ``group.at(rank)``): one ``StepReply`` per request,
        in order. The response is decoded (special tokens skipped) and ``formatter.action`` gives the action;
        ``obs_ids`` encode ``formatter.next(observation)`` (empty once the episode is over), told for chat
        turns whether the response ``stopped`` (it ends with the stop token, unless the request says). An
        ended episode is no longer held."""
        ids = [str(it.episode) for it in items]
        unknown = [i for i in ids if i not in self.episodes]
        if unknown or len(set(ids)) != len(ids):
            raise ValueError(
                f"step: episodes not held by env rank {self.ctx.group_rank} (ended, closed or "
                f"never reset) or repeated: {(unknown or ids)[:10]}"
            )
        responses = [list(it.response_ids) for it in items]
        stopped = [
            bool(r) and r[-1] == self.stop_id if it.stopped is None else it.stopped
            for it, r in zip(items, responses)
        ]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        actions = [self.formatter.action(t) for t in texts]
        jobs = [(k, self.episodes[i], ("step", a)) for k, (i, a) in enumerate(zip(ids, actions))]
        replies: list[StepReply] = []
        going: dict[int, str] = {}
        for (k, ep, _), (status, payload, secs) in zip(
            jobs, self._exchange(jobs, self.options.step_timeout_s)
        ):
            reply = StepReply(ep.id, action=actions[k], step_s=round(secs, 6))
            replies.append(reply)
            if status != "ok":
                self._forget(ep, status)
                self._ended(reply, _reason(status, payload))
                continue
            self.counters.steps += 1
            self.counters.step_s += secs
            for name in (
                "reward",
                "terminated",
                "truncated",
                "success",
                "state_key",
                "metrics",
                "use_tool",
            ):
                setattr(reply, name, payload[name])
            reply.observation = payload["observation"]
            if payload["terminated"] or payload["truncated"]:
                self._forget(ep, "done")
                self._ended(reply, "terminated" if payload["terminated"] else "truncated")
            else:
                obs = payload["observation"]
                going[k] = (
                    self.formatter.next(obs, stopped=stopped[k])
                    if self.next_takes_stopped
                    else self.formatter.next(obs)
                )
        for k, ids_ in zip(going, self._encode(list(going.values()), False)):
            replies[k].obs_ids = ids_
        return replies

    @register(Dispatch.ONE_TO_ALL)
    def close_episodes(self, ids: list[str]) -> int:
        """Close and forget these episodes (aborted or abandoned); ids this rank does not hold (ended
        already, or on another rank) are skipped, so closing is idempotent. Returns how many were closed."""
        closed = 0
        for i in ids:
            ep = self.episodes.get(str(i))
            if ep is not None:
                self._forget(ep, "done")
                self.counters.end("closed")
                closed += 1
        return closed

    @register(Dispatch.ONE_TO_ALL)
    def metrics(self) -> dict[str, float]:
        """This rank's counters since start: env_episodes_started / _live / _ended, env_ended_terminated /
        _truncated / _closed, env_timeouts, env_errors, env_invalid (each fault ends one episode), env_steps,
        env_step_s_mean, env_reset_s_mean."""
        return self.counters.as_dict(len(self.episodes))

    def close(self) -> None:
        for ep in list(self.episodes.values()):
            self._forget(ep, "done")
        self.host.stop(grace_s=self.options.step_timeout_s)

    # -- internals ------------------------------------------------------------------------------------------

    def _exchange(
        self, jobs: list[tuple[int, _EpisodeProcess, tuple]], timeout_s: float
    ) -> list[tuple[str, Any, float]]:
        """Send each job's command to its episode process, at most ``workers`` in flight, and collect
        ``(status, payload, seconds)`` per job in order: status ok / error / invalid (the process's answer),
        timeout (no answer within ``timeout_s`` of sending: the process is killed at once) or died."""
        results: list[tuple[str, Any, float] | None] = [None] * len(jobs)
        waiting = deque(range(len(jobs)))
        in_flight: dict[int, float] = {}  # job -> when it was sent
        selector = selectors.DefaultSelector()
        try:
            while waiting or in_flight:
                while waiting and len(in_flight) < self.workers:
                    j = waiting.popleft()
                    ep, command = jobs[j][1], jobs[j][2]
                    try:
                        ep.conn.send(command, timeout_s)
                    except OSError:
                        results[j] = ("died", None, 0.0)
                        continue
                    in_flight[j] = time.perf_counter()
                    selector.register(ep.conn.sock, selectors.EVENT_READ, j)
                if not in_flight:
                    continue
                first_deadline = min(in_flight.values()) + timeout_s
                for key, _ in selector.select(max(0.0, first_deadline - time.perf_counter())):
                    j = key.data
                    try:
                        complete, reply = jobs[j][1].conn.poll()
                    except EOFError:
                        complete, reply = True, ("died", None)
                    if complete:
                        results[j] = (*reply, time.perf_counter() - in_flight.pop(j))
                        selector.unregister(key.fileobj)
                now = time.perf_counter()
                late = [j for j, sent in in_flight.items() if now - sent >= timeout_s]
                for j in late:
                    results[j] = ("timeout", None, now - in_flight.pop(j))
                    selector.unregister(jobs[j][1].conn.sock)
                self.host.kill([jobs[j][1].pid for j in late])
        finally:
            selector.close()
        return results  # type: ignore[return-value]

    def _forget(self, ep: _EpisodeProcess, status: str) -> None:
        """Stop holding ``ep``. A process that answered is told to close its environment and exit (it does
        so under the time limit by itself); a hung one has been killed; a dead one has nothing to close."""
        self.episodes.pop(ep.id, None)
        self._drop(ep, status)

    def _drop(self, ep: _EpisodeProcess, status: str) -> None:
        if status not in ("timeout", "died"):
            try:
                ep.conn.send(("close", None), 1.0)
            except OSError:
                pass
        ep.conn.close()

    def _ended(self, reply: ResetReply | StepReply, reason: str) -> None:
        reply.ended = reason
        count = self.counters.end(reason)
        if reason.split(":", 1)[0] in FAULTS and (count <= 5 or count % 100 == 0):
            log.warning(
                "env role %s: episode %s ended: %s (%d such so far)",
                self.ctx.role,
                reply.episode,
                reason,
                count,
            )

    def _encode(self, texts: list[str], special_tokens: bool) -> list[list[int]]:
        if not texts:
            return []
        return [
            list(ids)
            for ids in self.tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]
        ]


def _reason(status: str, payload: object) -> str:
    if status == "timeout":
        return "timeout"
    if status == "died":
        return "error: the environment process died"
    return f"{status}: {payload}"


def _formatter(
    turns: str, tokenizer: PreTrainedTokenizerBase, system: str | None, eos_token: str | None
) -> TurnFormatter:
    if turns == "plain":
        return PlainTextTurns()
    if eos_token is None:
        return ChatTemplateTurns(tokenizer, system=system)
    return ChatTemplateTurns(tokenizer, system=system, eos_token=eos_token)


def _raise_open_files_limit() -> None:
    """One socket per live episode: lift the soft open-files limit (often 1024) toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
