"""The batch script's side of checkpoint-and-requeue: what happens around the ``srun`` of a Slurm run.

    python -m rollhpc.launch.requeue start RUN_DIR                      before srun
    python -m rollhpc.launch.requeue watch RUN_DIR SRUN_PID --grace S    beside srun
    python -m rollhpc.launch.requeue after RUN_DIR STATUS --max-restarts N [--max-continuations M]
                                                                         after srun, with its status

``start`` records the attempt (job id, Slurm's restart count, every het group's nodes) in
RUN_DIR/restarts.jsonl. A run that has already finished (its controller ended cleanly, or its newest
checkpoint is its last step) is never started again, whatever Slurm did to the job (a node lost just after
the last step makes Slurm requeue a job with nothing left to do): ``start`` says so and prints
``finished``, and the batch script ends with 0.

``watch`` (``rollhpc.launch.watch``) ends the step once the controller has ended (its exit record
written, or its process gone) and srun has not followed within the grace: srun waits for every task, and a
task on a lost node whose slurmd came back before Slurm marked it DOWN is known to nobody any more, so srun
would wait until the time limit. The decision never depends on srun: ``after`` reads the controller's record.

``after`` decides from srun's status, and continues the run in a new job (``rollhpc.launch.resubmit``:
no wait for Slurm to declare a lost node DOWN nor for its credential expiry; RUN_DIR/slurm/job_id then
names the new job), or, where sbatch cannot be run from the batch host, requeues this one:

The status is the controller's own (RUN_DIR/controller-exit.json, written by rank 0 as it leaves), not
srun's: srun reports the worst status of all tasks, and a killed worker's 137 would hide the controller's
76. srun's status counts only when the controller died without a word.

* ``EXIT_REQUEUE`` (75): the run saved a checkpoint because the time-limit warning came
  (``#SBATCH --signal=B:USR1@N`` -> the batch shell's trap -> RUN_DIR/stop-request): continue, without
  using up ``--max-restarts`` (a four-week run of 48-hour jobs continues 13 times); ``--max-continuations``,
  where given, bounds these.
* ``EXIT_WORKER_LOST`` (76): a worker process vanished (its node died, it was killed): the controller
  wrote the node to RUN_DIR/failed-nodes.json; restart with those nodes excluded, up to ``--max-restarts``
  restarts after failures (counted across jobs from RUN_DIR/restarts.jsonl, each requeue event with its cause:
  ``rollhpc.rundir.records.restarts_by_cause``, which the rescue job and ``rollhpc status`` read too). The
  requeue fallback goes
  ``scontrol requeuehold`` -> ``update ExcNodeList`` -> ``release`` (a running job's excluded nodes cannot
  be changed, a held one's can), once the lost node's step has ended.
* the world never formed: a rank's MPI_Init or first collectives timed out, or the controller gave up on
  a worker that never connected (RUN_DIR/startup-failed.json, from ``rollhpc.launch.mpi_init_guard`` and
  ``rollhpc.rank``), or srun failed before the controller wrote RUN_DIR/world.json for this attempt (a
  rank crashed in start-up, e.g. inside the MPI library): restart like a lost worker, nodes unchanged.
* anything else (0, a Python error in a worker, a bad config): no restart; the job ends with it.

When the node that dies is the batch host itself, this script dies with it: the job (``--no-requeue``) ends
NODE_FAIL and its rescue job (``rollhpc.launch.rescue``) continues the run, a failure like a lost worker.
Should a job that had just submitted its successor be started again, ``start`` sees the live successor and
prints ``superseded``: two jobs never run one run. Either way the next start resumes from the newest good
checkpoint (``pipelines.rlvr``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple


from rollhpc.launch.finished import finished_run
from rollhpc.launch.resubmit import cancel_rescue, current_job, ensure_rescue, resubmit
from rollhpc.launch.slurm_cli import (
    down_nodes,
    excluded_nodes,
    job_alive,
    scontrol,
    slurmd_started_since,
)
from rollhpc.launch.slurm_job import (
    allocated_nodes,
    group_nodes,
    job_components,
    job_steps,
    shared_nodes,
)
from rollhpc.launch.watch import cmd_watch
from rollhpc.proc.attempt import restart_number, slurm_restart_count
from rollhpc.proc.mpi_shm import ATTEMPT_STARTED
from rollhpc.rundir import RunPaths, atomic_write_text
from rollhpc.rundir.failure_kind import FailureKind
from rollhpc.rundir.records import (
    CONTINUATION,
    CONTINUATION_REASON,
    FAILURE,
    controller_exit,
    controller_failure,
    failed_nodes,
    log_event,
    read_events,
    restarts_by_cause,
    startup_failure,
)

EXIT_REQUEUE = 75  # EX_TEMPFAIL: checkpoint saved, run me again
EXIT_WORKER_LOST = 76  # a worker process is gone: worth a restart elsewhere
FINISHED = "finished"  # what ``start`` prints when the run has nothing left to do
SUPERSEDED = "superseded"  # what ``start`` prints when a newer job of the run is pending or running
REQUEUED = "requeued"  # what ``start`` prints when it requeued the job before srun (het groups sharing a node)


def unresponsive_nodes(hosts: list[str]) -> list[str]:
    """Of ``hosts``, the nodes Slurm says are DOWN or not responding (none outside a Slurm job, or when
    scontrol cannot answer): the controller's second witness of a lost node, beside the sideband."""
    if not hosts or not os.environ.get("SLURM_JOB_ID"):
        return []
    return down_nodes(hosts)


def wait_for_steps_to_end(
    run_dir: Path, job_id: str, lost: set[str], timeout_s: float = 180.0, poll_s: float = 0.5
) -> None:
    """Before a requeue that excludes a lost node: wait until Slurm has settled this attempt's steps.

    A step on a crashed node ends only once Slurm declares the node DOWN (then Slurm requeues the job itself,
    and the next start avoids the node). Requeued and released onto other nodes before that, Slurm 22.05
    breaks the job's GPU bookkeeping ("_step_get_gres_cnt ... node offset invalid": the next srun is refused)
    and, requeued again, may leave it pending forever. Settled also: the node's slurmd came back (restarted
    since this attempt began): it answers the requeue, though Slurm would never end the step it forgot. A
    worker lost on a live node: its step ends within a second. Waiting after ``requeuehold`` is no option: it
    ends this script (SIGKILL after KillWait)."""
    deadline = time.monotonic() + timeout_s
    began = float(os.environ.get(ATTEMPT_STARTED, "0") or 0) or time.time()

    def settled() -> bool:
        return not job_steps(job_id) or (
            bool(lost) and all(slurmd_started_since(n, began) for n in lost)
        )

    if settled():
        return
    log_event(
        run_dir,
        {
            "event": "wait",
            "job_id": job_id,
            "nodes": sorted(lost),
            "reason": "the lost node's step has not ended yet: requeueing once Slurm has ended it "
            "(or requeued the job itself, having marked the node DOWN), or the node is back",
        },
    )
    while not settled() and time.monotonic() < deadline:
        time.sleep(poll_s)


def _log_requeue(
    run_dir: Path,
    job_id: str,
    reason: str,
    exclude: set[str],
    failure: dict[str, Any] | None,
    cause: str,
    **fields: object,
) -> None:
    """The run's requeue event: why (and whether a failure: ``cause``), which nodes it leaves out from now on,
    and the verdict behind it."""
    log_event(
        run_dir,
        {
            "event": "requeue",
            "job_id": job_id,
            **fields,
            "cause": cause,
            "reason": reason,
            "exclude": sorted(exclude),
            "restart": restart_number() + 1,
            "slurm_restart_count": slurm_restart_count(),
            **({"failure": failure} if failure else {}),
        },
    )


def restart(
    run_dir: Path,
    job_id: str,
    reason: str,
    exclude: set[str],
    failure: dict[str, Any] | None = None,
    cause: str = FAILURE,
) -> int:
    """Continue the run in a new job (``rollhpc.launch.resubmit``: no wait for a lost node to be declared
    DOWN, nor for Slurm's credential expiry), excluding ``exclude`` and whatever this job excluded; where
    sbatch cannot be used from the batch host, requeue this job instead. ``cause``: a failure, or a
    continuation (rollhpc.rundir.records)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a kill now would lose the run's continuation
    excluded = set(exclude)
    for comp in job_components(job_id):
        excluded |= excluded_nodes(comp)
    new_job, why = resubmit(run_dir, excluded, restart_number() + 1)
    if new_job is not None:
        _log_requeue(run_dir, job_id, reason, exclude, failure, cause, new_job_id=new_job)
        return 0
    print(
        f"rollhpc requeue: cannot continue in a new job ({why}): requeueing job {job_id}",
        file=sys.stderr,
    )
    if exclude:
        wait_for_steps_to_end(run_dir, job_id, exclude)
    return requeue(run_dir, job_id, reason, exclude, failure=failure, cause=cause)


def requeue(
    run_dir: Path,
    job_id: str,
    reason: str,
    exclude: set[str],
    per_group: dict[int, set[str]] | None = None,
    failure: dict[str, Any] | None = None,
    cause: str = FAILURE,
) -> int:
    """Requeue this job (it is killed and starts again later), excluding ``exclude`` from then on, and
    ``per_group[i]`` from het group i only."""
    # requeuehold kills the batch script; finish the release first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    per_group = per_group or {}
    by_group = {str(i): sorted(n) for i, n in per_group.items()}
    _log_requeue(
        run_dir,
        job_id,
        reason,
        exclude,
        failure,
        cause,
        **({"exclude_per_group": by_group} if by_group else {}),
    )
    # the run's jobs are --no-requeue (a rescue job continues them):
    for comp in job_components(job_id):
        scontrol("update", f"JobId={comp}", "Requeue=1")  # scontrol requeue needs the flag back on
    if not exclude and not per_group:
        res = scontrol("requeue", job_id)
        return 0 if res.returncode == 0 else _failed(res, "requeue")
    res = scontrol("requeuehold", job_id)
    if res.returncode != 0:
        return _failed(res, "requeuehold")
    _exclude_while_held(job_id, exclude, per_group)
    res = scontrol("release", job_id)
    return 0 if res.returncode == 0 else _failed(res, "release")


def _exclude_while_held(job_id: str, exclude: set[str], per_group: dict[int, set[str]]) -> None:
    """Add ``exclude`` (and group i's ``per_group[i]``) to each held component's ExcNodeList."""
    for i, comp in enumerate(job_components(job_id)):
        if not (exclude | per_group.get(i, set())):
            continue
        nodes = ",".join(sorted(excluded_nodes(comp) | exclude | per_group.get(i, set())))
        upd = scontrol("update", f"JobId={comp}", f"ExcNodeList={nodes}")
        if upd.returncode != 0:
            print(
                f"rollhpc requeue: could not exclude {nodes} for {comp}: {upd.stderr.strip()}",
                file=sys.stderr,
            )


def _failed(res: subprocess.CompletedProcess[str], what: str) -> int:
    print(
        f"rollhpc requeue: scontrol {what} failed ({res.returncode}): {res.stderr.strip()}",
        file=sys.stderr,
    )
    return 1


def _take_over(run_dir: Path, job_id: str, successor: str | None) -> None:
    """This job continues the run (submitted by hand, or the record is older): record it, and make sure it
    has its rescue job."""
    if successor != job_id:
        RunPaths(run_dir).slurm.mkdir(parents=True, exist_ok=True)
        atomic_write_text(RunPaths(run_dir).job_id, job_id + "\n")
    ensure_rescue(run_dir, job_id)


def _requeue_shared(run_dir: Path, job_id: str, shared: dict[int, set[str]]) -> int:
    """Het groups given a node an earlier group has: srun cannot start the step, so requeue without it."""
    where = "; ".join(
        f"het group {i} shares {', '.join(sorted(n))} with an earlier group"
        for i, n in shared.items()
    )
    print(
        f"rollhpc requeue: {where}: srun cannot start one MPI step over het groups that share a node "
        f"(it waits forever); requeued with those nodes excluded for those groups",
        file=sys.stderr,
    )
    requeue(run_dir, job_id, f"{where} (srun cannot start such a step)", set(), shared)
    print(REQUEUED, flush=True)
    return 0


def _previous_attempt(events: list[dict[str, Any]]) -> str | None:
    """How the run's last attempt ended ("requeue", "end", or killed without a report); None: no attempt."""
    starts = [e for e in events if e.get("event") == "start"]
    if not starts:
        return None
    later = events[events.index(starts[-1]) + 1 :]
    ended = [e for e in later if e.get("event") in ("requeue", "end")]
    return (
        ended[-1]["event"] if ended else "killed without a report (its batch node lost, or scancel)"
    )


def cmd_start(run_dir: Path) -> int:
    """Before srun: record this attempt, unless the run has finished, another job continues it, or its het
    groups share a node (then this job is requeued); each of those prints its word for the batch script."""
    if done := finished_run(run_dir):
        reason = f"the run has already finished ({done}): nothing to start"
        _end(run_dir, 0, slurm_restart_count=slurm_restart_count(), reason=reason)
        print(f"rollhpc requeue: {reason}", file=sys.stderr)
        print(FINISHED, flush=True)
        return 0
    job_id = os.environ.get("SLURM_JOB_ID", "")
    successor = current_job(run_dir)
    if job_id and successor and successor != job_id and job_alive(successor):
        reason = f"job {successor} continues the run already: nothing to start"
        log_event(
            run_dir,
            {
                "event": "end",
                "status": 0,
                "job_id": job_id,
                "restart": restart_number(),
                "reason": reason,
            },
        )
        print(SUPERSEDED, flush=True)
        return 0
    if job_id:
        _take_over(run_dir, job_id, successor)
    shared = shared_nodes(group_nodes())
    if shared and job_id:
        return _requeue_shared(run_dir, job_id, shared)
    previous = _previous_attempt(read_events(run_dir))
    # an earlier attempt's world; this one's proves it formed
    RunPaths(run_dir).world.unlink(missing_ok=True)
    log_event(
        run_dir,
        {
            "event": "start",
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart": restart_number(),
            "slurm_restart_count": slurm_restart_count(),
            "nodes": allocated_nodes(),
            "batch_host": os.environ.get("SLURMD_NODENAME"),
            "previous_attempt": previous,
        },
    )
    return 0


def previous_failure(run_dir: Path) -> dict[str, Any]:
    """The failure verdict that made the run's last restart (its newest requeue event), {} if none."""
    requeues = [e for e in read_events(run_dir) if e.get("event") == "requeue"]
    return (requeues[-1].get("failure") or {}) if requeues else {}


def cmd_after(
    run_dir: Path,
    srun_status: int,
    max_restarts: int,
    allow_requeue: bool = True,
    max_continuations: int | None = None,
) -> int:
    """After srun: restart the run, or end it, from the controller's exit status (srun's, when the
    controller said nothing); the batch script exits with what this returns. ``max_restarts`` bounds the
    restarts after failures, ``max_continuations`` (None: no bound) those after a time limit."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    try:
        return _after(
            run_dir, srun_status, Bounds(max_restarts, max_continuations), allow_requeue, job_id
        )
    finally:
        # this batch script continued the run in a new job or ended it: its rescue job (rollhpc.launch.rescue)
        # has nothing left to do. A job requeued in place keeps its rescue for its next attempt.
        events = read_events(run_dir)
        if job_id and (current_job(run_dir) != job_id or (events and events[-1].get("final"))):
            cancel_rescue(run_dir, job_id)


class Bounds(NamedTuple):
    """How often a run may go on in a new job: after failures (``cluster.max_restarts``) and after time limits
    (``cluster.max_continuations``, None: no bound)."""

    restarts: int
    continuations: int | None = None


def _end(run_dir: Path, status: int, **fields: object) -> int:
    """The run ends here for good (a rescue job finds this and leaves it ended)."""
    log_event(
        run_dir,
        {
            "event": "end",
            "status": status,
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart": restart_number(),
            "final": True,
            **fields,
        },
    )
    return status


def _stalled_world(run_dir: Path, said: int | None, srun_status: int) -> str | None:
    """Why the MPI world never formed, or None: no controller to say anything (a rank's MPI_Init guard or
    its deadline on the first collectives recorded it), the controller gave up waiting for a worker to
    connect, or srun failed before this attempt's world.json was written."""
    stalled = startup_failure(run_dir) if said in (None, EXIT_WORKER_LOST) else None
    if (
        stalled is None
        and said is None
        and srun_status != 0
        and not RunPaths(run_dir).world.exists()
    ):
        return (
            f"srun exited {srun_status} before every rank had joined; the ranks' own errors "
            f"are in the output above"
        )
    return stalled["why"] if stalled else None


def _same_failure_again(run_dir: Path, kind: FailureKind | None, failure: dict[str, Any]) -> bool:
    """A lost worker or peer with the signature of the failure that made the last restart: the run's own."""
    sig = failure.get("signature")
    return (
        kind in (FailureKind.LOST_PEER, FailureKind.LOST_WORKER)
        and bool(sig)
        and previous_failure(run_dir).get("signature") == sig
    )


def _after_lost_worker(
    run_dir: Path, job_id: str, status: int, failure: dict[str, Any], max_restarts: int
) -> int:
    """A lost worker, unless the verdict names another kind worth a restart (or none was recorded):
    restart without the lost nodes, unless out of restarts or the same failure came twice in a row."""
    kind = FailureKind.of(failure.get("kind", FailureKind.LOST_WORKER))
    said_kind = kind if kind is not None and kind.restartable else FailureKind.LOST_WORKER
    what = said_kind.requeue_says(failure.get("summary", ""))
    counts = restarts_by_cause(read_events(run_dir))
    if counts[FAILURE] >= max_restarts:
        return _end(
            run_dir,
            status,
            failure=failure or None,
            bound="max_restarts",
            reason=f"{what} and the run already restarted {counts[FAILURE]} times after failures "
            f"(max_restarts={max_restarts}; its {counts[CONTINUATION]} continuation(s) after a time limit "
            "do not count): giving up",
        )
    if _same_failure_again(run_dir, kind, failure):
        return _end(
            run_dir,
            status,
            failure=failure,
            reason=f"the same failure twice in a row at step {failure.get('step')} "
            f"({failure.get('summary', '')}): taken as deterministic (the run's own, e.g. a "
            "crash in native code or out of memory), not restarted again",
        )
    # which node is at fault is unknown: the next attempt gets the same nodes
    if kind != FailureKind.LOST_WORKER:
        return restart(run_dir, job_id, what, set(), failure)
    failed = failed_nodes(run_dir)
    return restart(
        run_dir,
        job_id,
        f"worker lost on {', '.join(sorted(failed)) or 'an unknown node'}",
        set(failed),
        failure,
    )


def _continue_after_time_limit(
    run_dir: Path, job_id: str, status: int, max_continuations: int | None
) -> int:
    """The run checkpointed at the time-limit warning (or was asked to stop): continue it in a new job, unless a
    site's bound on continuations is reached."""
    done = restarts_by_cause(read_events(run_dir))[CONTINUATION]
    if max_continuations is not None and done >= max_continuations:
        return _end(
            run_dir,
            status,
            bound="max_continuations",
            reason=f"the run stopped at a time limit and already continued {done} times after one "
            f"(max_continuations={max_continuations}): ending here, its checkpoint saved; continue it with "
            f"slurm/resume.sh {run_dir}",
        )
    return restart(run_dir, job_id, CONTINUATION_REASON, set(), cause=CONTINUATION)


def _final_fields(said: int | None, srun_status: int, failure: dict[str, Any]) -> dict[str, object]:
    """What the final end records beside its status: srun's own status where it differs from the
    controller's, the failure verdict, and why a failure of the run's own ends it without a restart."""
    extra: dict[str, object] = (
        {"srun_status": srun_status} if said is not None and said != srun_status else {}
    )
    if failure:
        extra["failure"] = failure
        ended_by = FailureKind.of(failure.get("kind"))
        if ended_by is not None and not ended_by.restartable:
            if why := ended_by.requeue_says(failure.get("summary", "")):
                extra["reason"] = why
    return extra


def _after(
    run_dir: Path, srun_status: int, bounds: Bounds, allow_requeue: bool, job_id: str
) -> int:
    said = controller_exit(run_dir)
    status = srun_status if said is None else said
    failure = controller_failure(run_dir) if said is not None else {}
    if status != srun_status:
        print(
            f"rollhpc requeue: srun exited {srun_status}, the controller {status}: deciding by the controller's",
            file=sys.stderr,
        )
    # e.g. a worker lost after the final checkpoint
    if status != 0 and (done := finished_run(run_dir)):
        return _end(
            run_dir,
            0,
            srun_status=srun_status,
            reason=f"the run has finished ({done}); status {status} ends nothing",
        )
    if (stalled := _stalled_world(run_dir, said, srun_status)) is not None:
        status = EXIT_WORKER_LOST
        failure = {"kind": FailureKind.WORLD_NOT_FORMED, "summary": stalled}
        print(f"rollhpc requeue: {stalled}", file=sys.stderr)
    if status in (EXIT_REQUEUE, EXIT_WORKER_LOST) and not allow_requeue:
        return _end(
            run_dir,
            status,
            failure=failure or None,
            reason=f"cluster.requeue is off: continue the run with slurm/resume.sh {run_dir}",
        )
    if status == EXIT_REQUEUE and job_id:
        return _continue_after_time_limit(run_dir, job_id, status, bounds.continuations)
    if status == EXIT_WORKER_LOST and job_id:
        return _after_lost_worker(run_dir, job_id, status, failure, bounds.restarts)
    return _end(run_dir, status, **_final_fields(said, srun_status, failure))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rollhpc.launch.requeue", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="record this attempt (before srun)")
    s.add_argument("run_dir", type=Path)
    w = sub.add_parser("watch", help="end srun's step once the controller has ended (beside srun)")
    w.add_argument("run_dir", type=Path)
    w.add_argument("srun_pid", type=int)
    w.add_argument(
        "--grace", type=float, default=1.0, help="seconds srun may take to end by itself"
    )
    w.add_argument(
        "--world-timeout", type=float, help="seconds for the world to form before the step is ended"
    )
    a = sub.add_parser("after", help="requeue or end, from srun's exit status")
    a.add_argument("run_dir", type=Path)
    a.add_argument("status", type=int)
    a.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts after failures (lost workers, peers or nodes), at most",
    )
    a.add_argument(
        "--max-continuations",
        type=int,
        default=None,
        help="continuations after a time limit, at most (default: no bound)",
    )
    a.add_argument(
        "--no-requeue", action="store_true", help="never requeue (cluster.requeue=false): just end"
    )
    args = p.parse_args(argv)
    if args.cmd == "start":
        return cmd_start(args.run_dir)
    if args.cmd == "watch":
        return cmd_watch(args.run_dir, args.srun_pid, args.grace, args.world_timeout)
    return cmd_after(
        args.run_dir,
        args.status,
        args.max_restarts,
        allow_requeue=not args.no_requeue,
        max_continuations=args.max_continuations,
    )


if __name__ == "__main__":
    sys.exit(main())
