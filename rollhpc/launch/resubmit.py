"""Restart a Slurm run as a new job (its successor) instead of requeueing the job it ran in.

Why not ``scontrol requeue``: a requeued job keeps its id, and Slurm starts it again only once the old
attempt has completed everywhere and its credentials have expired. A node that died holds the job in
COMPLETING until Slurm declares the node DOWN (SlurmdTimeout: 300 s by default, ~25 s on the local test
cluster), and every requeue then waits ``cred_expire`` (120 s by default) more. A new job waits for neither:
the nodes that finished are released one by one, so the successor, with the lost node excluded, can start
within a second or two while the old job still completes on the dead node. Resubmitting from the batch
script is the usual "job chaining" of long HPC trainings.

What the successor gets: the batch script ``rollhpc submit`` wrote (RUN_DIR/slurm/batch.sh), with
``--exclude`` in every het component for the nodes lost so far (and any the old job excluded), and the
submitting environment without the old job's SLURM_* variables, plus ROLLHPC_RESTART_BASE so that restarts
keep counting across jobs (``rollhpc.proc.attempt``). RUN_DIR/slurm/job_id then names the successor:
``rollhpc status``, ``submit --wait`` and ``slurm/resume.sh`` follow it. Should Slurm requeue the old job
anyway (its batch node died in the same second), that attempt finds a live successor and ends at once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from rollhpc.launch import slurm_cli
from rollhpc.launch.slurm_cli import job_alive
from rollhpc.proc.attempt import RESTART_BASE
from rollhpc.rundir import RunPaths, atomic_write_text

KEEP_SLURM_VARS = ("SLURM_CONF",)  # client settings of the submitting user, not the old job's
_GROUP = re.compile(r"^# het group \d+:")
_EXCLUDE = re.compile(r"^#SBATCH\s+(?:--exclude=|-x\s*)(\S+)\s*$")


def current_job(run_dir: Path) -> str | None:
    """The run's current Slurm job (RUN_DIR/slurm/job_id), or None."""
    try:
        return RunPaths(run_dir).job_id.read_text().strip() or None
    except OSError:
        return None


def with_exclusions(text: str, exclude: set[str]) -> str:
    """The batch text with ``exclude`` added to every het component's ``--exclude`` (placed at the end of
    each component's #SBATCH block, merged with one already there)."""
    if not exclude:
        return text
    lines = text.split("\n")
    out: list[str] = []
    in_block, have = False, set()

    def close_block() -> None:
        nonlocal in_block, have
        if in_block:
            out.append(f"#SBATCH --exclude={','.join(sorted(have | exclude))}")
        in_block, have = False, set()

    for line in lines:
        if _GROUP.match(line):
            close_block()
            in_block = True
            out.append(line)
            continue
        if in_block:
            m = _EXCLUDE.match(line)
            if m:
                have |= slurm_cli.hostnames(m.group(1))
                continue
            if line.strip() == "#SBATCH hetjob" or not line.startswith("#SBATCH"):
                close_block()
        out.append(line)
    close_block()
    return "\n".join(out)


def successor_env(restarts: int) -> dict[str, str]:
    """The environment the run was submitted with: the old job's SLURM_* (its id, nodes, restart count) would
    mislead the new one; ROLLHPC_RESTART_BASE carries the count of restarts instead."""
    env = _slurm_free_env()
    env[RESTART_BASE] = str(restarts)
    return env


def resubmit(run_dir: Path, exclude: set[str], restarts: int) -> tuple[str | None, str]:
    """Submit the run's successor job; (its id, "") or (None, why it could not be submitted)."""
    template = RunPaths(run_dir).batch_script
    try:
        text = template.read_text()
    except OSError as e:
        return None, f"no batch script to resubmit ({e})"
    script = RunPaths(run_dir).slurm / f"batch-restart-{restarts}.sh"
    atomic_write_text(script, with_exclusions(text, exclude))
    try:
        res = slurm_cli.sbatch(str(script), env=successor_env(restarts), cwd=str(run_dir))
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"sbatch failed: {e}"
    job_id = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not job_id.isdigit():
        return None, f"sbatch failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}"
    atomic_write_text(RunPaths(run_dir).job_id, job_id + "\n")
    print(
        f"rollhpc requeue: submitted job {job_id} to continue the run (script {script})",
        file=sys.stderr,
        flush=True,
    )
    rescue, why = submit_rescue(run_dir, job_id)
    if rescue is None and why:
        print(
            f"rollhpc requeue: job {job_id} has no rescue job: {why}", file=sys.stderr, flush=True
        )
    return job_id, ""


def _slurm_free_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("SLURM_") and k not in KEEP_SLURM_VARS)
        and not k.startswith("ROLLHPC_ATTEMPT_")
    }


def submit_rescue(run_dir: Path, job_id: str) -> tuple[str | None, str]:
    """Queue the rescue job of ``job_id``: it waits, holding nothing, until that job has ended
    (``--dependency=afterany``) and then continues the run if nobody else did (``rollhpc.launch.rescue``).
    (its id, "") or (None, why not); no rescue script (cluster.requeue=false): (None, "")."""
    script = RunPaths(run_dir).rescue_script
    if not script.exists():
        return None, ""
    try:
        res = slurm_cli.sbatch(
            f"--dependency=afterany:{job_id}",
            "--kill-on-invalid-dep=yes",
            str(script),
            job_id,
            env=_slurm_free_env(),
            cwd=str(run_dir),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"sbatch failed: {e}"
    rescue = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not rescue.isdigit():
        return None, f"sbatch failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}"
    rescues = rescue_jobs(run_dir)
    rescues[job_id] = rescue
    atomic_write_text(RunPaths(run_dir).rescues, json.dumps(rescues, indent=1) + "\n")
    return rescue, ""


def ensure_rescue(run_dir: Path, job_id: str) -> None:
    """At each start: this job has a rescue job waiting (one submitted with it is; a job whose submitter died
    between its sbatch and its rescue's, or a job submitted by hand, gets one now)."""
    if not RunPaths(run_dir).rescue_script.exists():
        return
    rescue = rescue_jobs(run_dir).get(job_id)
    if rescue and job_alive(rescue):
        return
    new, why = submit_rescue(run_dir, job_id)
    if new is None:
        print(
            f"rollhpc requeue: job {job_id} has no rescue job: {why}", file=sys.stderr, flush=True
        )


def rescue_jobs(run_dir: Path) -> dict[str, str]:
    """{job id: its rescue job's id} of the run (RUN_DIR/slurm/rescues.json; {} when there is none)."""
    try:
        return dict(json.loads(RunPaths(run_dir).rescues.read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def cancel_rescue(run_dir: Path, job_id: str) -> None:
    """``job_id``'s batch script continued or ended the run itself: its rescue job has nothing to do."""
    rescue = rescue_jobs(run_dir).get(job_id)
    if rescue:
        try:
            slurm_cli.scancel(rescue)
        except (OSError, subprocess.TimeoutExpired):
            pass  # it would find the run continued, or ended, and leave at once
