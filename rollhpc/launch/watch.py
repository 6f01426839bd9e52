"""``python -m rollhpc.launch.requeue watch``: beside srun, end the step once the controller has ended.

srun waits for every task, and a task on a lost node whose slurmd came back before Slurm marked it DOWN is
known to nobody any more, so srun would wait until the time limit. The watcher ends the step once the
controller has ended (its exit record written, or its process gone) and srun has not followed within the
grace; the decision what to do next is ``after``'s, from the controller's record, never srun's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from rollhpc.launch.slurm_cli import scancel_detached
from rollhpc.launch.slurm_job import job_steps
from rollhpc.rundir import RunPaths
from rollhpc.rundir.records import (
    controller_exit,
    log_event,
    record_startup_failure,
    startup_failure,
    this_host,
)


def controller_ended(run_dir: Path) -> str | None:
    """How this attempt's controller ended, or None while it runs: its exit record, or its process gone
    (looked up in world.json when the controller runs on this host, as rank 0 does on the batch host)."""
    status = controller_exit(run_dir)
    if status is not None:
        return f"the controller ended with status {status}"
    try:
        controller = json.loads(RunPaths(run_dir).world.read_text())[0]
    except (FileNotFoundError, ValueError, IndexError, KeyError):
        return None
    if controller.get("host") != this_host():
        return None
    try:
        os.kill(int(controller["pid"]), 0)
    except ProcessLookupError:
        return f"the controller (pid {controller['pid']}) is gone without a word"
    except (PermissionError, KeyError, TypeError, ValueError):
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        # reaps it if it is our child (tests); the batch shell reaps srun
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _still_alive_after(pid: int, seconds: float) -> bool:
    """Whether ``pid`` still runs after waiting up to ``seconds`` for it to end."""
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pid)


def _world_not_formed(run_dir: Path, world_timeout_s: float) -> tuple[str, bool]:
    """Why the world did not form in time, and whether srun itself is stuck (no rank's guard said a word,
    so the ranks never ran: then the start-up failure is recorded here, and srun gets no grace)."""
    failed = startup_failure(run_dir)
    if failed is not None:
        # the ranks' guards gave up, and srun waits on: for a task on a node lost while the world formed
        # whose slurmd came back knowing nothing
        return f"the MPI world did not form ({failed['why']})", False
    how = (
        f"no MPI world formed within {world_timeout_s:g} s of srun's start and no rank said why "
        f"(srun or the process manager is stuck before the ranks run)"
    )
    record_startup_failure(run_dir, this_host(), how)
    return how, True


def _wait_for_an_end(
    run_dir: Path, srun_pid: int, world_timeout_s: float | None, poll_s: float
) -> tuple[str | None, bool]:
    """Poll while srun runs: (how the controller ended or the world failed to form, whether srun is stuck);
    (None, False) once srun has ended by itself."""
    started = time.monotonic()
    while _alive(srun_pid):
        if how := controller_ended(run_dir):
            return how, False
        if (
            world_timeout_s is not None
            and time.monotonic() - started > world_timeout_s
            and not RunPaths(run_dir).world.exists()
        ):
            return _world_not_formed(run_dir, world_timeout_s)
        time.sleep(poll_s)
    return None, False


def _end_step(run_dir: Path, srun_pid: int, how: str, grace_s: float) -> None:
    """End every het component's step of this job, then srun itself should it still wait."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    steps = job_steps(job_id) if job_id else []
    log_event(
        run_dir,
        {
            "event": "step-ended",
            "job_id": job_id,
            "steps": steps,
            "reason": f"{how}, and srun had not ended {grace_s:g} s later: its step is ended",
        },
    )
    # not waited for: slurmctld may take MessageTimeout per node it cannot reach, and the
    # requeue that follows ends whatever of the step is left anyway
    for step in steps:
        try:
            scancel_detached("--signal=KILL", step)
        except OSError as e:
            print(f"rollhpc requeue: cannot end step {step}: {e}", file=sys.stderr)
    # a srun waiting for a lost node's task may outlive its cancelled step
    if _still_alive_after(srun_pid, 1):
        os.kill(srun_pid, signal.SIGKILL)


def cmd_watch(
    run_dir: Path,
    srun_pid: int,
    grace_s: float,
    world_timeout_s: float | None = None,
    poll_s: float = 0.5,
) -> int:
    """Beside srun: once the controller has ended, give srun ``grace_s`` to end by itself, then end the step
    (every het component's) and, if srun still waits, srun itself; the batch script goes on to ``after``.
    A world that has not formed ``world_timeout_s`` after srun started, with no rank's guard heard from (the
    ranks never started: srun itself is stuck), is recorded as a start-up failure and ended the same way."""
    # the time-limit warning is the batch shell's business
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    how, srun_stuck = _wait_for_an_end(run_dir, srun_pid, world_timeout_s, poll_s)
    if how is None:
        return 0
    if srun_stuck:
        grace_s = 0
    if _still_alive_after(srun_pid, grace_s):
        _end_step(run_dir, srun_pid, how, grace_s)
    return 0
