"""Why a run stops: each error names the rank, role and call it concerns."""

from __future__ import annotations


class RunFailed(RuntimeError):
    """Base of the failures that end a run; ``summary`` is the one line shown to the user."""

    summary: str = ""
    details: str = ""

    def __init__(self, summary: str, details: str = ""):
        super().__init__(summary)
        self.summary = summary
        self.details = details


class WorkerError(RunFailed):
    """A worker raised inside a call; ``details`` holds its traceback. ``role``, ``method``, ``err_type`` and
    ``message`` are the parts the failure classification reads (``rollhpc.controller.failure``)."""

    def __init__(
        self,
        summary: str,
        details: str = "",
        *,
        role: str = "",
        method: str = "",
        err_type: str = "",
        message: str = "",
    ):
        super().__init__(summary, details)
        self.role, self.method, self.err_type, self.message = role, method, err_type, message


class WorkerDied(RunFailed):
    """A worker process disappeared (killed, crashed in native code, node lost). ``host``: the node it ran
    on (Slurm's node name under Slurm), which a requeue excludes."""

    def __init__(
        self,
        summary: str,
        details: str = "",
        host: str = "",
        *,
        role: str = "",
        method: str = "",
        collective_timeout: bool = False,
    ):
        super().__init__(summary, details)
        # method: the call it was running, "" if idle
        self.host, self.role, self.method = (
            host,
            role,
            method,
        )
        # it ended itself: NCCL's watchdog found a collective past its timeout (a peer's fault, as often as not)
        self.collective_timeout = collective_timeout


class WorldNotFormed(RunFailed):
    """The MPI world never came together (a rank missing from the first collectives, a worker that never
    connected): nothing of the run has started, and the process manager or network is the suspect, so a
    restart is worth trying."""


class CallTimeout(RunFailed):
    """A wait for workers ran past its limit; stacks of all ranks were dumped."""
