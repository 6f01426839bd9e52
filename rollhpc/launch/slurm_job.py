"""This Slurm job as its batch script sees it: its het components, its running steps and every group's nodes,
read from the environment Slurm gives the batch shell (``SLURM_HET_SIZE``, ``SLURM_JOB_NODELIST_HET_GROUP_i``)
and from scontrol and squeue (``rollhpc.launch.slurm_cli``). Outside a Slurm job each answer is empty."""

from __future__ import annotations

import os
import subprocess
import sys

from rollhpc.launch.slurm_cli import scontrol, step_ids


def het_size() -> int:
    """How many het groups this job has (0 outside a het job)."""
    return int(os.environ.get("SLURM_HET_SIZE", "0") or 0)


def job_components(job_id: str) -> list[str]:
    """["123"] for a plain job, ["123+0", "123+1", ...] for a heterogeneous one."""
    n = het_size()
    return [f"{job_id}+{i}" for i in range(n)] if n > 1 else [job_id]


def _per_group(variable: str) -> list[str]:
    """``variable``_HET_GROUP_i of each het group, the empty ones left out ([] for a plain job)."""
    n = het_size()
    values = [os.environ.get(f"{variable}_HET_GROUP_{i}", "") for i in range(n)] if n > 1 else []
    return [v for v in values if v]


def job_steps(job_id: str) -> list[str]:
    """This job's running steps of srun ("123.0", and "124.0" for het group 1's component), batch and
    extern steps left out: each het component's step is ended under the component's own job id."""
    steps = []
    for comp in _per_group("SLURM_JOB_ID") or [job_id]:
        try:
            out = step_ids(comp)
        except (OSError, subprocess.TimeoutExpired) as e:  # srun itself is still killed below
            print(f"rollhpc requeue: cannot list the steps of {comp}: {e}", file=sys.stderr)
            continue
        steps += [s for s in out if s.startswith(f"{comp}.") and s.split(".")[1].isdigit()]
    return steps


def group_nodes() -> list[list[str]]:
    """The nodes of each het group of this attempt (one list for a plain job; none outside Slurm)."""
    lists = _per_group("SLURM_JOB_NODELIST") or [os.environ.get("SLURM_JOB_NODELIST", "")]
    out = []
    for nodelist in filter(None, lists):
        res = scontrol("show", "hostnames", nodelist)
        out.append(res.stdout.split() if res.returncode == 0 else [nodelist])
    return out


def shared_nodes(groups: list[list[str]]) -> dict[int, set[str]]:
    """{group index: its nodes that an earlier group also has}: Slurm may pack het groups onto one node,
    and srun (22.05) then fails to start the step ("_reorder_het_job_recs: Invalid hostlist") and waits."""
    seen: set[str] = set()
    shared = {}
    for i, hosts in enumerate(groups):
        if both := seen & set(hosts):
            shared[i] = both
        seen |= set(hosts)
    return shared


def allocated_nodes() -> list[str]:
    """This attempt's nodes, every het group's (a het job's SLURM_JOB_NODELIST names only group 0's)."""
    hosts: list[str] = []
    for group in group_nodes():
        hosts += [h for h in group if h not in hosts]
    return hosts
