"""What ended a run: a lost worker, a lost peer, or an error in the run's own code, decided without racing.

When a node dies in the middle of a collective (a weight sync, the trainer's gradient all-reduce, a pipeline
send), the survivors' collectives fail at once ("Connection reset by peer" from gloo, an NCCL remote error),
often before the controller has seen the death itself. Taken at its word, the first error to arrive is a
worker's exception in user code, and the run would end for good. So the controller classifies before it
decides, in a bounded look:

* a worker found gone (its sideband connection closed, or Slurm says its node is DOWN / not responding)
  within the look that follows a communication error: the run lost a worker; the error was its echo.
  Restart without that node. The same role dying in the same call at the same step right after a restart is
  a crash of the run's own (in native code, out of memory), not bad luck twice: the run ends. A worker that
  died while idle, or on a node Slurm calls down, was running none of the run's work: never the same failure
  (two nodes lost at the same step, one after the other, are two losses), bounded by cluster.max_restarts.
* no worker found gone, but the error is a communication error (gloo / NCCL / MPI / torch.distributed
  network errors, a collective's timeout) or the controller's own wait timed out (a call past its limit, an
  MPI call that never returned): a lost peer whose loss
  nobody could pin on a node (a flaky link, a node that hung without dying). Restart on the same nodes;
  the same failure twice in a row (same role, call, error and step) is taken as deterministic and ends the
  run (``rollhpc.launch.requeue`` compares the signatures).
* anything else: an error in the run's code or data, whatever dies meanwhile (a worker whose constructor
  failed, its peers in a collective). A restart would meet it again: the run ends.

The verdict's kind is a ``rollhpc.rundir.failure_kind.FailureKind``: the requeue and ``rollhpc status`` read the
same vocabulary back from the run directory.

Pure logic: the caller supplies the liveness probes (``rollhpc.rank``), so this module imports nothing above it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rollhpc.controller.errors import (
    CallTimeout,
    RunFailed,
    WorkerDied,
    WorkerError,
    WorldNotFormed,
)
from rollhpc.rundir.failure_kind import FailureKind

# Errors that a dead or unreachable peer causes in the survivors, whatever library raised them. Matched against
# the exception's type and message (not the traceback: user code mentioning "timeout" must not count).
_COMM_TYPES = re.compile(
    r"^(DistNetworkError|DistBackendError|DistStoreError|ConnectionResetError|"
    r"ConnectionAbortedError|ConnectionRefusedError|BrokenPipeError|NcclError|ProcFailed)$"
    r"|MPI\.Exception"
)
_COMM_TEXT = re.compile(
    r"gloo/transport|Connection reset by peer|Connection closed by peer|Connection refused|Broken pipe|"
    r"No route to host|Socket Timeout|Timed out waiting|timed out after|NCCL (?:error|communicator|WARN)|"
    r"ncclRemoteError|ncclSystemError|ncclInternalError|remote process exited|Watchdog caught collective|"
    r"ProcessGroup\w* .*(?:abort|timeout)|MPI_ERR_|ProcFailed|ECONNRESET|EPIPE",
    re.IGNORECASE,
)


# What torch's NCCL watchdog writes before it takes its process down: a collective past its timeout, or the
# watchdog itself stuck. The rank that dies of it waited for a peer; its node is as likely healthy as not.
_WATCHDOG_ABORT = re.compile(
    r"Watchdog caught collective operation timeout|ProcessGroupNCCL's watchdog got stuck|"
    r"taking the entire process down"
)


def is_watchdog_abort(log_tail: str) -> bool:
    """Whether a dead rank's last log lines say NCCL's watchdog ended it (a collective that timed out)."""
    return bool(_WATCHDOG_ABORT.search(log_tail or ""))


def is_communication_error(err_type: str, message: str) -> bool:
    """Whether an exception (its type name and message) is what a lost peer causes in a collective."""
    return bool(_COMM_TYPES.search(err_type or "") or _COMM_TEXT.search(message or ""))


@dataclass
class Failure:
    """The controller's verdict on a failed run: what ``rollhpc.launch.requeue after`` decides by and what
    ``rollhpc status`` shows. ``hosts``: nodes to keep away from (a lost worker's); ``signature``: the same
    failure seen again at the same step is deterministic; ``cause``: the error that surfaced first, when the
    verdict names another (a worker's communication error that was the echo of another worker's death)."""

    kind: FailureKind
    summary: str
    hosts: list[str] = field(default_factory=list)
    signature: str = ""
    cause: str = ""
    step: int | None = None

    @property
    def restartable(self) -> bool:
        return self.kind.restartable

    def record(self) -> dict[str, Any]:
        """The verdict as the run directory keeps it (controller-exit.json, restarts.jsonl): the kind writes as its
        plain string; empty fields are left out."""
        return {k: v for k, v in asdict(self).items() if v not in ("", [], None)}


def _normalized(text: str) -> str:
    """A message without what changes from one occurrence to the next (numbers, addresses, paths' digits)."""
    return re.sub(r"0x[0-9a-f]+|\d+", "#", text or "", flags=re.IGNORECASE)[:300]


def signature(
    kind: FailureKind, role: str, method: str, err_type: str, message: str, step: int | None
) -> str:
    return "|".join([kind, role, method, err_type, _normalized(message), str(step)])


def lost_signature(dead: WorkerDied, step: int | None) -> str:
    """A lost worker's signature for the same-failure-twice rule, or "" where a repeat says nothing about the
    run's own code: the worker was idle (no call of the run's was running in it) or is known only from Slurm's
    node state: two reward ranks' nodes lost at the same step, one after the other, are two losses, not a
    deterministic failure."""
    return (
        signature(FailureKind.LOST_WORKER, dead.role, dead.method, "", "", step)
        if dead.method
        else ""
    )


def classify(
    exc: BaseException,
    dead_worker: Callable[[], WorkerDied | None],
    down_hosts: Callable[[], list[str]],
    host_ranks: Callable[[str], list[str]] | None = None,
    settle_s: float = 15.0,
    step: int | None = None,
) -> tuple[BaseException, Failure]:
    """(the exception to report, the verdict). ``dead_worker()``: a worker found gone now (the sideband);
    ``down_hosts()``: nodes of the world that Slurm says are down or not responding; ``host_ranks(host)``:
    the ranks on a node, for the message. A communication error gets the whole ``settle_s`` look (a dead
    node's TCP connections may take keepalive's ~11 s to drop); a timeout, or an error on the controller
    itself, a look of a second; a worker's error that is no communication error none: a death that follows it
    is its consequence (its peers in a collective, a constructor that failed), not its cause."""
    verdict = _verdict_of_its_own(exc, step)
    if verdict is not None:
        return exc, verdict
    err = _Surfaced.of(exc)
    if isinstance(exc, WorkerError) and not err.comm:
        return exc, err.verdict(FailureKind.ERROR, exc.summary, step)
    look = settle_s if err.comm else min(settle_s, 1.0)
    summary = getattr(exc, "summary", "") or f"{type(exc).__name__}: {exc}"
    if (found := _death_within(look, dead_worker, down_hosts, host_ranks)) is not None:
        return _echo_of_death(exc, *found, summary, step)
    if err.comm or err.timeout:
        return exc, err.verdict(
            FailureKind.LOST_PEER,
            f"{summary} (a communication error or timeout, and no worker was "
            f"found gone within {look:g} s: a lost peer, restarted on the same "
            "nodes)",
            step,
        )
    return exc, err.verdict(FailureKind.ERROR, summary, step)


def _verdict_of_its_own(exc: BaseException, step: int | None) -> Failure | None:
    """The verdict an error carries by its type alone (a worker's death, a world that never formed), without a
    look at the workers; None for every other error."""
    if isinstance(exc, WorkerDied) and exc.collective_timeout:
        # a lost peer, whichever: no node is blamed
        return _signed(FailureKind.LOST_PEER, exc.summary, step, exc.role, exc.method, "watchdog")
    if isinstance(exc, WorkerDied):
        return Failure(
            FailureKind.LOST_WORKER,
            exc.summary,
            [exc.host] if exc.host else [],
            lost_signature(exc, step),
            step=step,
        )
    if isinstance(exc, WorldNotFormed):
        return Failure(FailureKind.WORLD_NOT_FORMED, exc.summary, step=step)
    return None


@dataclass(frozen=True)
class _Surfaced:
    """What the classification reads off the error that surfaced first: where it was raised (a worker's role and
    call), its type and message, and whether it is what a lost peer causes."""

    role: str = ""
    method: str = ""
    err_type: str = ""
    message: str = ""
    # a communication error (gloo / NCCL / MPI / torch.distributed network errors)
    comm: bool = False
    # the controller's own wait ran past its limit; it watched the workers all along: a short look finds a
    # late death
    timeout: bool = False

    @classmethod
    def of(cls, exc: BaseException) -> _Surfaced:
        if isinstance(exc, WorkerError):
            comm = is_communication_error(exc.err_type, exc.message)
            return cls(exc.role, exc.method, exc.err_type, exc.message, comm=comm)
        if isinstance(exc, (CallTimeout, StalledCall)):
            return cls(err_type=type(exc).__name__, message=str(exc), timeout=True)
        if isinstance(exc, RunFailed):
            return cls(message=str(exc))
        err_type = type(exc).__name__
        return cls(
            err_type=err_type, message=str(exc), comm=is_communication_error(err_type, str(exc))
        )

    def verdict(self, kind: FailureKind, summary: str, step: int | None) -> Failure:
        return _signed(kind, summary, step, self.role, self.method, self.err_type, self.message)


def _echo_of_death(
    exc: BaseException, dead: WorkerDied, hosts: list[str], summary: str, step: int | None
) -> tuple[WorkerDied, Failure]:
    """A worker found gone after an error: the run lost it, and the error that surfaced first was its echo."""
    died = WorkerDied(
        f"{dead.summary}; the error that surfaced first was its echo: {summary}",
        getattr(exc, "details", "") or dead.details,
        host=dead.host,
        role=dead.role,
        method=dead.method,
    )
    return died, Failure(
        FailureKind.LOST_WORKER,
        died.summary,
        hosts,
        lost_signature(dead, step),
        cause=summary,
        step=step,
    )


def _signed(
    kind: FailureKind,
    summary: str,
    step: int | None,
    role: str = "",
    method: str = "",
    err_type: str = "",
    message: str = "",
) -> Failure:
    """A verdict with its signature: the same kind, role, call and error at the same step again is the same
    failure (``rollhpc.launch.requeue`` ends a run that meets one twice in a row)."""
    return Failure(
        kind, summary, signature=signature(kind, role, method, err_type, message, step), step=step
    )


def _death_within(
    look: float,
    dead_worker: Callable[[], WorkerDied | None],
    down_hosts: Callable[[], list[str]],
    host_ranks: Callable[[str], list[str]] | None,
) -> tuple[WorkerDied, list[str]] | None:
    """(the worker found gone within ``look`` seconds, the hosts to keep away from), or None: none was, or one
    ended by NCCL's watchdog (it waited on a peer, as the error did: no node to blame)."""
    deadline = time.monotonic() + look
    next_slurm = 0.0  # Slurm's view is asked once a second (a controller of thousands of ranks asks one service)
    while True:
        dead = dead_worker()
        if dead is not None and dead.collective_timeout:
            return None
        if dead is not None:
            return dead, [dead.host] if dead.host else []
        if time.monotonic() >= next_slurm:
            next_slurm = time.monotonic() + 1.0
            if hosts := down_hosts():
                who = ", ".join(
                    f"{h} ({', '.join(host_ranks(h))})" if host_ranks else h for h in hosts
                )
                return WorkerDied(
                    f"node {who} of the run is down or not responding (Slurm's view)", host=hosts[0]
                ), hosts
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


class StalledCall(RunFailed):
    """An MPI call on the controller that never returned (``rollhpc.controller.mpi_stall``) and no worker
    found gone: a peer that is unreachable without having died, a broken network."""
