"""The run's own records in its directory, written by whichever process knows and read by the batch script's
requeue logic, ``rollhpc status`` and the report: its events (restarts.jsonl: starts, requeues, ends), the nodes
it lost workers on, the controller's exit status and failure verdict, and a world that did not form. Records of
one attempt carry its Slurm job id and restart count, so a later attempt never reads an earlier one's as its own.

Light on purpose (no torch, no MPI): the batch script and every rank's start-up guard use it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from rollhpc.proc.attempt import restart_number, slurm_restart_count
from rollhpc.rundir import RunPaths, atomic_write_json, read_jsonl


def this_host() -> str:
    """This node's name as Slurm knows it (simulated nodes of one machine share its hostname)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def log_event(run_dir: Path, event: dict[str, Any]) -> None:
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **event}
    path = RunPaths(run_dir).restarts
    with open(path, "ab+") as f:
        torn = False
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"  # the last writer was killed mid-line
        f.write((("\n" if torn else "") + json.dumps(record) + "\n").encode())
    print(f"rollhpc requeue: {json.dumps(record)}", file=sys.stderr, flush=True)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(RunPaths(run_dir).restarts)  # a line torn by a kill is skipped


# Why a run went on in a new job (a requeue event's "cause"). A failure (a lost worker, peer or node, a world that
# did not form, a job Slurm ended before the run could continue itself) uses up cluster.max_restarts; a
# continuation (the checkpoint at the time-limit warning, or a stop the run was asked for) is how a run longer than
# one job's time limit goes on, and only cluster.max_continuations (unbounded by default) bounds it.
FAILURE = "failure"
CONTINUATION = "continuation"
CONTINUATION_REASON = (
    "checkpoint saved at the time-limit warning"  # the batch script's words for one
)


def restart_cause(event: dict[str, Any]) -> str:
    """A requeue event's cause; an event written before causes were recorded, by its reason."""
    cause = event.get("cause")
    if cause in (FAILURE, CONTINUATION):
        return cause
    return CONTINUATION if str(event.get("reason", "")).startswith(CONTINUATION_REASON) else FAILURE


def restarts_by_cause(events: list[dict[str, Any]]) -> dict[str, int]:
    """How often the run went on in a new job so far, by cause: ``{"failure": n, "continuation": m}``. The one
    count the batch script, the rescue job and ``rollhpc status`` all read."""
    counts = {FAILURE: 0, CONTINUATION: 0}
    for event in events:
        if event.get("event") == "requeue":
            counts[restart_cause(event)] += 1
    return counts


def failed_nodes(run_dir: Path) -> dict[str, str]:
    """{node: why} of the nodes the run lost workers on so far (RUN_DIR/failed-nodes.json; {} when none)."""
    try:
        return dict(json.loads(RunPaths(run_dir).failed_nodes.read_text()))
    except (FileNotFoundError, ValueError):
        return {}


def record_failed_node(run_dir: Path, host: str, why: str) -> None:
    """Called by the controller when a worker died: the node to keep away from on the next start."""
    if not host:
        return
    nodes = failed_nodes(run_dir)
    nodes[host] = why
    atomic_write_json(RunPaths(run_dir).failed_nodes, nodes, indent=1)


def _attempt() -> dict[str, Any]:
    return {"job_id": os.environ.get("SLURM_JOB_ID"), "restart_count": slurm_restart_count()}


def record_controller_exit(
    run_dir: Path, status: int, failure: dict[str, Any] | None = None
) -> None:
    """The controller's own exit status, for ``after``: srun reports the worst status of all tasks (a
    killed worker's 137 hides the controller's 76), so the decision travels through the run directory.
    ``failure``: the controller's verdict on a failure (``rollhpc.controller.failure.Failure.record``)."""
    atomic_write_json(
        RunPaths(run_dir).controller_exit,
        {
            "status": status,
            **_attempt(),
            "restart": restart_number(),
            **({"failure": failure} if failure else {}),
        },
    )


def _this_attempts(path: Path) -> dict[str, Any] | None:
    """The record at ``path`` if this attempt (Slurm job id and restart count) wrote it; None when there is none,
    it is unreadable, or an earlier attempt left it."""
    try:
        record = json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if {k: record.get(k) for k in ("job_id", "restart_count")} == _attempt() else None


def controller_failure(run_dir: Path) -> dict[str, Any]:
    """This attempt's failure verdict from the controller's exit record ({} when none: no failure, no record)."""
    return (_this_attempts(RunPaths(run_dir).controller_exit) or {}).get("failure") or {}


def controller_exit(run_dir: Path) -> int | None:
    """This attempt's controller exit status, or None (it died before saying, or the file is older)."""
    record = _this_attempts(RunPaths(run_dir).controller_exit)
    return None if record is None else int(record["status"])


def record_startup_failure(run_dir: Path, host: str, why: str, culprit: bool = False) -> None:
    """The MPI world did not form (a rank's guard, rollhpc.launch.mpi_init_guard, or the controller waiting for
    connections): RUN_DIR/startup-failed.json for ``after`` (worth a restart), and error.json for the user
    unless a rank already wrote one. Of an attempt's records the first is kept, unless a later one comes
    from the ``culprit`` (a rank stuck in MPI_Init itself, which the others were only waiting for)."""
    run_dir = Path(run_dir)
    earlier = startup_failure(run_dir)
    error = RunPaths(run_dir).error
    if earlier is not None and (earlier.get("culprit") or not culprit):
        # error.json too, in the kept record's words, if it is not there yet: the rank that wrote that record may
        # be killed between its two files (when this caller kills its own rank, the launcher ends the others, and
        # a guard dies with its rank), and the launcher then had no word to show (a flaky start-up test)
        if not error.exists():
            _write_world_not_formed(error, earlier["why"])
        return
    atomic_write_json(
        RunPaths(run_dir).startup_failed,
        {"host": host, "why": why, "culprit": culprit, **_attempt()},
    )
    # the culprit's word over a waiting rank's
    if not error.exists() or (culprit and earlier is not None):
        _write_world_not_formed(error, why)


def _write_world_not_formed(error: Path, why: str) -> None:
    write_error(error, why, "WorldNotFormed", why, indent=None)


def write_error(
    path: Path, summary: str, type_name: str, details: str, indent: int | None = 1
) -> None:
    """RUN_DIR/error.json: the one-line ``summary`` the user sees, what kind of error, its ``details``
    (a traceback, the list of misplaced ranks), and when."""
    atomic_write_json(
        path,
        {
            "summary": summary,
            "type": type_name,
            "details": details,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        indent=indent,
    )


def startup_failure(run_dir: Path) -> dict[str, Any] | None:
    """This attempt's start-up failure record, or None (none, or one left by an earlier attempt)."""
    return _this_attempts(RunPaths(run_dir).startup_failed)
