"""The kinds of failure that end an attempt: one vocabulary for the controller's verdict
(``rollhpc.controller.failure``), the batch script's requeue decision (``rollhpc.launch.requeue``) and
``rollhpc status``.

A ``str`` enum on purpose: a member is written to JSON as its plain value, the same string older runs wrote to
controller-exit.json and restarts.jsonl, and a record read back (a plain string) compares equal to its member. So
runs recorded by an older rollhpc still read, and no reader needs to convert before it compares.

Each kind carries its words beside it: how ``rollhpc status`` describes it, and what the requeue says of it
(the reason of a restart for a kind worth restarting, of the end for one that is not).

A leaf module (the standard library only): the batch script's light requeue code imports it.
"""

from __future__ import annotations

from enum import StrEnum


class FailureKind(StrEnum):
    """What ended an attempt. Each member: (its JSON value, ``description``, ``requeue_says``)."""

    LOST_WORKER = ("lost_worker", "a lost worker (node or process gone)", "a worker was lost")
    LOST_PEER = (
        "lost_peer",
        "a lost peer (a communication error or timeout, no node found gone)",
        "a lost peer: {summary}",
    )
    WORLD_NOT_FORMED = (
        "world_not_formed",
        "the MPI world did not form",
        "the MPI world did not form: {summary}",
    )
    ERROR = (
        "error",
        "an error of the run's own",
        "an error in the run's own code or data, not a lost node or peer: not restarted (a restart would meet "
        "it again): {summary}",
    )
    DISK_FULL = (
        "disk_full",
        "the run's filesystem full or over quota",
        "out of disk space: not restarted (a restart would meet it again until space is freed): {summary}",
    )
    INTERRUPTED = ("interrupted", "a signal (scancel, Ctrl-C)", "")
    PLACEMENT = (
        "placement",
        "ranks not on the hosts, GPUs or cores the plan gave them",
        "ranks not where the plan put them: not restarted (the same srun line would place them the same "
        "way): {summary}",
    )

    description: str  # for a person, as ``rollhpc status`` shows the last failure
    _requeue_says: (
        str  # a template with ``{summary}``; "" where the requeue says nothing of its own
    )

    def __new__(cls, value: str, description: str, requeue_says: str) -> FailureKind:
        # the value alone is the member's string (its JSON form); the words ride along as attributes
        member = str.__new__(cls, value)
        member._value_ = value
        member.description = description
        member._requeue_says = requeue_says
        return member

    @property
    def restartable(self) -> bool:
        """Whether a restart may well succeed: the fault was a node's or the network's, not the run's own."""
        return self in _RESTARTABLE

    def requeue_says(self, summary: str) -> str:
        """The requeue's reason in restarts.jsonl for this kind of failure (``summary``: the verdict's own words):
        why the run restarts, for a restartable kind; why it ends for good, for one that is not ("": no reason)."""
        return self._requeue_says.format(summary=summary)

    @classmethod
    def of(cls, value: object) -> FailureKind | None:
        """The kind a record names (its JSON string, or a member); None for none or one this rollhpc does not know."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            return None


_RESTARTABLE = frozenset(
    {FailureKind.LOST_WORKER, FailureKind.LOST_PEER, FailureKind.WORLD_NOT_FORMED}
)
