"""Every Slurm command rollhpc runs (``scontrol``, ``sacct``, ``squeue``, ``sbatch``, ``scancel``) and the parsing
of what it prints, in one place.

Light on purpose (the standard library only): the batch script's requeue and rescue code imports it on a compute
node before anything heavy. Each call has a timeout; what a caller does when slurmctld cannot answer differs
(a status report says so, a liveness check answers "not alive"), so the functions say which they return.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Mapping

# Slurm's end states of a job
TERMINAL = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)
# a job that only completes on a dead node will not run the run again
ENDED = TERMINAL | {"COMPLETING"}
HOLD_STATES = {"REQUEUE_HOLD", "SPECIAL_EXIT"}  # requeued and held, whatever the Reason says
# `Key=value` pairs of `scontrol show job -o`; a value runs up to the next ` Key=` (Slurm writes a Reason's
# spaces as underscores, but Comment=, Command= ... may hold spaces)
_FIELD = re.compile(r"([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)")


def run(
    args: list[str], timeout: float, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """A Slurm command, its output captured as text (OSError / TimeoutExpired are the caller's)."""
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
        cwd=cwd,
    )


# ---- scontrol show job ----


def parse_job_records(text: str) -> list[dict[str, str]]:
    """``scontrol show job -o`` output -> one dict per line (a het job has one line per component)."""
    return [
        {m.group(1): m.group(2) for m in _FIELD.finditer(line)}
        for line in text.splitlines()
        if line.startswith("JobId=")
    ]


def job_records(job_id: str, timeout: float = 30) -> tuple[list[dict[str, str]] | None, str]:
    """(records, error): [] when slurmctld does not know the job (any more), None with the error when it
    cannot be asked (no scontrol here, the controller down)."""
    if shutil.which("scontrol") is None:
        return None, "scontrol not found (not a Slurm machine)"
    try:
        res = run(["scontrol", "show", "job", "-o", job_id], timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"scontrol: {e}"
    if res.returncode == 0:
        return parse_job_records(res.stdout), ""
    if "invalid job id" in res.stderr.lower():
        return [], ""
    said = [line for line in res.stderr.splitlines() if line.strip()]
    return None, said[-1].strip() if said else f"scontrol exited {res.returncode}"


def job_alive(job_id: str) -> bool:
    """Whether Slurm still has ``job_id`` pending or running (any het component); unknown -> False."""
    records, _ = job_records(job_id)
    return any(r.get("JobState", "") not in ENDED for r in records or [])


def excluded_nodes(job_id: str) -> set[str]:
    """The hosts in the job's (or het component's) ``ExcNodeList``, expanded; none when Slurm cannot say."""
    records, _ = job_records(job_id, timeout=60)
    for r in records or []:
        value = r.get("ExcNodeList", "")
        if value and value != "(null)":
            return hostnames(value)
    return set()


def held_reason(record: Mapping[str, str]) -> str | None:
    """Why Slurm holds this component ("launch failed requeued held", "JobHeldUser", ...), or None when it
    is not held. A held job never starts by itself: it waits for ``scontrol release``."""
    state, reason = record.get("JobState", ""), record.get("Reason", "").replace("_", " ")
    if state in HOLD_STATES or (state == "PENDING" and "held" in reason.lower()):
        return reason if reason and reason != "None" else state
    return None


def held_notice(job_id: str, reason: str) -> str:
    """The one line that tells a person a job is held and how to release it."""
    return f"job {job_id} is held by Slurm ({reason}): release it with: scontrol release {job_id}"


def restart_count(records: list[Mapping[str, str]]) -> int:
    """Slurm's restart count of the job (its attempt number): the highest ``Restarts`` of its components."""
    return max((int(r["Restarts"]) for r in records if r.get("Restarts", "").isdigit()), default=0)


# ---- nodes and host lists ----


def hostnames(expr: str) -> set[str]:
    """``node[1-3],gpu7`` -> its hosts (scontrol does the expansion; the text itself if it cannot)."""
    try:
        out = run(["scontrol", "show", "hostnames", expr], 30)
    except (OSError, subprocess.TimeoutExpired):
        return {expr}
    return set(out.stdout.split()) if out.returncode == 0 and out.stdout.strip() else {expr}


def node_records(nodes: list[str], timeout: float) -> list[dict[str, str]]:
    """``scontrol show node -o`` of ``nodes``, one dict per node; none when scontrol cannot answer."""
    try:
        out = run(["scontrol", "show", "node", "-o", ",".join(nodes)], timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines()]


def down_nodes(nodes: list[str]) -> list[str]:
    """Of ``nodes``, those Slurm says are DOWN or not responding (a ``*`` after the state)."""
    down = []
    for fields in node_records(nodes, timeout=10):
        state = fields.get("State", "")
        if fields.get("NodeName") in nodes and (
            "DOWN" in state or "NOT_RESPONDING" in state or state.endswith("*")
        ):
            down.append(fields["NodeName"])
    return down


def slurmd_started_since(node: str, since: float) -> bool:
    """Whether ``node``'s slurmd started after ``since`` (epoch seconds)."""
    for fields in node_records([node], timeout=30):
        try:
            return (
                time.mktime(time.strptime(fields.get("SlurmdStartTime", ""), "%Y-%m-%dT%H:%M:%S"))
                >= since
            )
        except ValueError:
            return False
    return False


# ---- sacct, squeue ----


def component_states(job_id: str) -> dict[str, str]:
    """State of each heterogeneous component ("123+0" -> "RUNNING"), from sacct.

    submitit's watcher looks the job up by its plain id, which sacct never lists for a heterogeneous
    job (only "123+0", "123+1", ...), so it would wait forever; this reads the components instead.
    """
    out = run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"], 60).stdout
    states = {}
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if jid == job_id or jid.startswith(f"{job_id}+"):
            states[jid] = state.split()[0] if state else "UNKNOWN"
    return states


def step_ids(job_id: str) -> list[str]:
    """The job's (or component's) running steps, as ``squeue -s`` names them ("123.0", ...)."""
    return run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], 30).stdout.split()


def jobs_named(user: str, name: str, states: str, fmt: str) -> list[str]:
    """``squeue`` lines (in ``fmt``) of ``user``'s jobs named ``name`` in ``states`` ("PD,R,...")."""
    return run(
        ["squeue", "-h", "-u", user, "-n", name, "-t", states, "-o", fmt], 60
    ).stdout.splitlines()


# ---- acting on jobs ----


def scontrol(*args: str) -> subprocess.CompletedProcess:
    """``scontrol ARGS`` (requeue, update, release, ...): the caller reads the return code."""
    return run(["scontrol", *args], 60)


def sbatch(
    *args: str, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``sbatch --parsable ARGS`` (options, the script, its arguments): the job id on stdout when the return code
    is 0."""
    return run(["sbatch", "--parsable", *args], 120, env, cwd)


def scancel(*args: str) -> subprocess.CompletedProcess:
    return run(["scancel", *args], 60)


def scancel_detached(*args: str) -> None:
    """``scancel ARGS`` not waited for (slurmctld may take MessageTimeout per node it cannot reach), itself ended
    after 60 s."""
    subprocess.Popen(
        ["timeout", "60", "scancel", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
