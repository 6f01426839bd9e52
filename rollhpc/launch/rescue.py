"""The rescue job: what continues a run when its batch script could not.

    python -m rollhpc.launch.rescue RUN_DIR JOB_ID --max-restarts N

Every job of a run is submitted together with a small rescue job (``rollhpc.launch.resubmit.submit_rescue``)
that waits in the queue with ``--dependency=afterany:JOB_ID``: it holds no node and runs nothing until that
job has ended, however it ended. Usually the job's own batch script has decided by then (the run finished,
failed for good, or continues in a new job) and cancels its rescue. When the batch script could not decide,
because it died with its node (the batch node lost at any moment, during a restart too), because the job
ended before it started (a failed launch), or because Slurm ended the job (a time limit without the warning,
a node failure), the rescue continues the run from its newest good checkpoint in a new job, with a rescue of
its own. Nobody waits on a login node, and no daemon runs outside Slurm.

The run's jobs are ``--no-requeue``: Slurm ends a job whose node died (NODE_FAIL) instead of requeueing it,
and a requeued job whose relaunch fails would be held forever ("launch failed requeued held"), with its
``afterany`` dependants waiting forever too. Ended, it sets its rescue off.

What the rescue never does: start a second copy of a live run (it leaves when any job of the run is pending or
running), restart a finished run (its last step's checkpoint, or a clean end), undo a decision (the run's
last event is a final end: an error of its own, out of restarts, requeue off), override a person (a job
cancelled with scancel stays cancelled), or go beyond ``cluster.max_restarts`` (which also bounds jobs that
keep ending before they start the run, a broken environment: their batch hosts are excluded as they fail).
Every continuation it makes is a failure's (a job that reached its time limit without the run stopping at the
warning counts as one: a hung run would otherwise go on for ever).
Each decision is a line in RUN_DIR/restarts.jsonl, which ``rollhpc status`` shows.
"""

from __future__ import annotations

import argparse
import getpass
import subprocess
import sys
from pathlib import Path
from typing import Any

from rollhpc.launch.finished import finished_run
from rollhpc.launch.resubmit import current_job, resubmit
from rollhpc.launch.slurm_cli import ENDED as ENDED_STATES
from rollhpc.launch.slurm_cli import hostnames, job_alive, jobs_named
from rollhpc.launch.slurm_cli import job_records as _job_records
from rollhpc.rundir import RunPaths
from rollhpc.rundir.records import (
    FAILURE,
    failed_nodes,
    log_event,
    read_events,
    restarts_by_cause,
)

RESCUED = "rescued"  # what the rescue prints when it continued the run in a new job
NOTHING = "nothing to do"  # ... when the run needs nothing from it
ENDED = "ended"  # ... when it ended the run for good (out of restarts, cancelled, no job to submit)


def final_end(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's final end, if its newest decisive event is one: a start or restart after it reopened the run."""
    for e in reversed(events):
        if e.get("event") in ("start", "requeue"):
            return None
        if e.get("event") == "end" and e.get("final"):
            return e
    return None


def job_records(job_id: str) -> list[dict[str, str]] | None:
    """Slurm's records of ``job_id`` (one per het component; [] when it forgot the job, None when unreachable)."""
    records, _ = _job_records(job_id)
    return records


def live_jobs_of_run(run_dir: Path, job_name: str) -> list[str]:
    """Pending or running jobs of this user named like the run's whose output goes to this run directory:
    a job submitted for the run but not yet recorded in RUN_DIR/slurm/job_id (its submitter died at once)."""
    try:
        out = "\n".join(jobs_named(getpass.getuser(), job_name, "PD,R,S,CF", "%i"))
    except (OSError, subprocess.TimeoutExpired):
        return []
    mine = str(RunPaths(Path(run_dir).resolve()).slurm) + "/"
    live = []
    for jid in sorted(set(j.split("+")[0] for j in out.split())):
        # every component: one still RUNNING makes the job live, and an
        for r in job_records(jid) or []:
            # ended one not
            if r.get("StdOut", "").startswith(mine) and r.get("JobState") not in ENDED_STATES:
                live.append(jid)
                break
    return live


def _job_name(run_dir: Path) -> str:
    for line in RunPaths(run_dir).batch_script.read_text().splitlines():
        if line.startswith("#SBATCH --job-name="):
            return line.partition("=")[2].strip()
    return ""


def restarts_so_far(events: list[dict[str, Any]]) -> int:
    """The restart number of the run's newest attempt, started or submitted (0: the first)."""
    return max(
        (int(e.get("restart") or 0) for e in events if e.get("event") in ("start", "requeue")),
        default=0,
    )


def _say(job_id: str, word: str, why: str) -> int:
    """Tell the person why (stderr) and the rescue's batch script what was done (stdout)."""
    print(f"rollhpc rescue: job {job_id}: {why}", file=sys.stderr, flush=True)
    print(word, flush=True)
    return 0


def _end_run(run_dir: Path, job_id: str, reason: str, **fields: object) -> None:
    """The rescue ends the run for good (its event says so: a later rescue leaves it ended)."""
    log_event(
        run_dir,
        {
            "event": "end",
            "status": 1,
            "job_id": job_id,
            "final": True,
            "by": "rescue",
            "reason": reason,
            **fields,
        },
    )


def _continued_elsewhere(run_dir: Path, job_id: str, events: list[dict[str, Any]]) -> str | None:
    """Why the run needs nothing from this rescue before Slurm is asked: it finished, ended for good, or
    the job of RUN_DIR/slurm/job_id continues it; None when it may."""
    if done := finished_run(run_dir):
        return f"the run has finished ({done})"
    if final := final_end(events):
        return (
            f"the run ended for good: {final.get('reason') or 'status ' + str(final.get('status'))}"
        )
    current = current_job(run_dir)
    if current and current != job_id and job_alive(current):
        return f"job {current} continues the run"
    return None


def _records_asking_twice(job_id: str) -> list[dict[str, str]]:
    """Slurm's records of ``job_id``, asked a second time when it did not answer the first ([] then)."""
    records = job_records(job_id)
    if records is None:
        print(
            f"rollhpc rescue: Slurm did not answer about job {job_id}; trying once more",
            file=sys.stderr,
        )
        records = job_records(job_id) or []
    return records


def _nodes_to_exclude(run_dir: Path, records: list[dict[str, str]], never: bool) -> set[str]:
    """The job's excluded nodes, the nodes the run lost workers on, and, for a job that never started the
    run (a failed launch), its batch host: Slurm may pick that node again before it marks it DOWN."""
    exclude = set()
    for r in records:
        if r.get("ExcNodeList") and r["ExcNodeList"] != "(null)":
            exclude |= hostnames(r["ExcNodeList"])
        if never and r.get("BatchHost") and r["BatchHost"] != "(null)":
            exclude.add(r["BatchHost"])
    return exclude | set(failed_nodes(run_dir))


def _continue(
    run_dir: Path,
    job_id: str,
    events: list[dict[str, Any]],
    records: list[dict[str, str]],
    how: str,
) -> int:
    """Submit the run's next job, without the nodes it should avoid, and record why."""
    restarts = restarts_so_far(events)
    never = not any(e.get("event") == "start" and e.get("job_id") == job_id for e in events)
    exclude = _nodes_to_exclude(run_dir, records, never)
    new_job, why = resubmit(run_dir, exclude, restarts + 1)
    if new_job is None:
        _end_run(
            run_dir,
            job_id,
            f"job {job_id} ended {how} without continuing the run, and its rescue could "
            f"not submit a new job: {why}",
        )
        return _say(job_id, ENDED, f"cannot submit: {why}")
    reason = (
        f"job {job_id} ended {how} before it started the run (a failed launch)"
        if never
        else f"job {job_id} ended {how} without continuing the run (its batch script was lost with its node, "
        "or Slurm ended the job first)"
    )
    log_event(
        run_dir,
        {
            "event": "requeue",
            "job_id": job_id,
            "new_job_id": new_job,
            "by": "rescue",
            "cause": FAILURE,
            "reason": reason,
            "exclude": sorted(exclude),
            "restart": restarts + 1,
        },
    )
    return _say(job_id, RESCUED, f"{reason}: continued in job {new_job}")


def cmd_rescue(run_dir: Path, job_id: str, max_restarts: int) -> int:
    """Once ``job_id`` has ended: continue its run in a new job, unless the run needs nothing from its rescue
    or must stay ended (cancelled by a person, out of restarts); prints the decision's word."""
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    if why := _continued_elsewhere(run_dir, job_id, events):
        return _say(job_id, NOTHING, why)
    records = _records_asking_twice(job_id)
    states = sorted({r.get("JobState", "") for r in records})
    # COMPLETING counts as ended: a het job's components end one by one (one NODE_FAIL, another still
    # COMPLETING). A job requeued in place runs again: its next start makes sure it has a rescue
    # (ensure_rescue).
    if any(st not in ENDED_STATES for st in states):
        return _say(job_id, NOTHING, f"job {job_id} is {'/'.join(states)} again")
    if live := [j for j in live_jobs_of_run(run_dir, _job_name(run_dir)) if j != job_id]:
        return _say(job_id, NOTHING, f"job {live[0]} of the run is pending or running")
    how = "/".join(st for st in states if st != "COMPLETING") or "unknown to Slurm"
    if set(states) <= {"CANCELLED", "COMPLETING"} and "CANCELLED" in states:
        _end_run(
            run_dir,
            job_id,
            f"job {job_id} was cancelled (scancel): the run stops here; continue it with "
            f"slurm/resume.sh {run_dir}",
        )
        return _say(job_id, ENDED, "cancelled by a person: left cancelled")
    failures = restarts_by_cause(events)[FAILURE]
    if failures >= max_restarts:
        _end_run(
            run_dir,
            job_id,
            f"job {job_id} ended {how} without continuing the run, and the run already "
            f"restarted {failures} times after failures (max_restarts={max_restarts}): giving up",
            bound="max_restarts",
        )
        return _say(job_id, ENDED, "out of restarts")
    return _continue(run_dir, job_id, events, records, how)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rollhpc.launch.rescue", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("job_id", help="the run's job this rescue waited for")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of the run, at most (cluster.max_restarts)",
    )
    args = p.parse_args(argv)
    return cmd_rescue(args.run_dir, args.job_id, args.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
