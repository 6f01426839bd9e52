"""A rank's own placement: its GPUs chosen before MPI or CUDA starts, and, once the world has formed, whether
its host, GPUs and cores are the ones the plan gave it.

Why before MPI: a CUDA-aware MPI (UCX, HPC-X, MVAPICH2-GDR, Cray's GTL) initialises CUDA inside ``MPI_Init``;
a CUDA_VISIBLE_DEVICES set afterwards is ignored and every rank of a node lands on GPU 0. So a rank learns
which plan rank it is from its launcher's environment (``launcher_rank``), binds its GPUs, and only then
starts MPI; the MPI rank is compared with that guess afterwards.

Why check afterwards: srun places tasks its own way when the batch script and the plan disagree (an uneven
last node rebalanced, a site default of ``--gpu-bind`` or ``--cpu-bind``), and a rank on the wrong node or
GPUs fails hours later as an out-of-memory or a hang. ``placement_problem`` says in one line what is wrong,
before any model loads. Light on purpose: no torch, no MPI at import (torch only to count a GPU node's GPUs).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from rollhpc.placement.device_mapping import RankPlacement, WorldPlan
from rollhpc.placement.hostlist import expand_hostlist

__all__ = [
    "RankFacts",
    "bind_gpus",
    "launcher_rank",
    "observe",
    "placement_problem",
    "planned_host",
    "shares_gpus",
]

# the rank as each launcher tells its processes, most specific first: MPICH's hydra and Slurm's pmi2 plugin
# (PMI_RANK), PMIx servers (Slurm's pmix, prrte), Open MPI's mpirun; srun's own task id last, since inside
# an allocation a non-srun launcher's processes inherit the batch step's SLURM_PROCID (0)
LAUNCHER_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
# srun sets this in every task it bound to a CPU mask ("mask_cpu:", "map_cpu:"); "none" or absent: not bound
_CPU_BIND_TYPE = "SLURM_CPU_BIND_TYPE"
_NVIDIA_CONTROL = "/dev/nvidiactl"  # present on a node with NVIDIA's driver loaded


def launcher_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's world rank as its launcher announced it, before MPI starts; None if no launcher said."""
    for var in LAUNCHER_RANK_VARS:
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def bind_gpus(local_gpus: tuple[int, ...]) -> str | None:
    """Point CUDA_VISIBLE_DEVICES at this rank's GPUs, chosen among those Slurm allocated to the step
    (never assumed to start at 0). Must run before anything initializes CUDA: before MPI_Init too."""
    if not local_gpus:
        return None
    allocated = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = allocated.split(",") if allocated else [str(i) for i in range(max(local_gpus) + 1)]
    if max(local_gpus) >= len(ids):
        raise RuntimeError(
            f"the plan gives this rank GPUs {list(local_gpus)} of its node, but only {len(ids)} were "
            f"allocated (CUDA_VISIBLE_DEVICES={allocated!r})"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in local_gpus)
    return os.environ["CUDA_VISIBLE_DEVICES"]


@dataclass(frozen=True)
class RankFacts:
    """What a rank finds about itself once its world has formed."""

    host: str  # as Slurm names the node (SLURMD_NODENAME), else the host name
    cuda_visible_devices: str | None
    gpu_count: int | None  # GPUs CUDA shows this process; None where the node has no NVIDIA driver
    cpus: tuple[int, ...]  # the cores this process may run on (its affinity)
    cpu_bound: bool  # srun bound it to a CPU mask
    # of its GPUs, asked only where the plan shares them with other ranks
    compute_modes: tuple[str, ...] = ()


def _gpu_count(local_gpus: tuple[int, ...]) -> int | None:
    if not local_gpus or not os.path.exists(_NVIDIA_CONTROL):
        return None
    import torch  # the rank's role imports it next anyway; counting does not create a CUDA context

    return torch.cuda.device_count()


def shares_gpus(me: RankPlacement, plan: WorldPlan) -> bool:
    """Whether another rank of the plan uses one of this rank's GPUs (colocated roles take turns on them)."""
    return bool(me.gpus) and any(
        p.rank != me.rank
        and p.component == me.component
        and p.node == me.node
        and set(p.gpus) & set(me.gpus)
        for p in plan.ranks
    )


def _compute_modes(visible: str | None) -> tuple[str, ...]:
    """nvidia-smi's compute mode of each visible GPU (e.g. "Default", "Exclusive_Process"); () if unknown."""
    if not visible or not os.path.exists(_NVIDIA_CONTROL):
        return ()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", visible],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (
        tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
        if out.returncode == 0
        else ()
    )


def observe(
    host: str, me: RankPlacement, plan: WorldPlan, environ: Mapping[str, str] = os.environ
) -> RankFacts:
    """This process's facts (its GPUs counted, and their compute mode asked where the plan shares them)."""
    bind = environ.get(_CPU_BIND_TYPE, "")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return RankFacts(
        host,
        visible,
        _gpu_count(me.gpus),
        tuple(sorted(os.sched_getaffinity(0))),
        bind.startswith(("mask_cpu", "map_cpu")),
        _compute_modes(visible) if shares_gpus(me, plan) else (),
    )


def planned_host(
    me: RankPlacement, plan: WorldPlan, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The host the plan's node of this rank is, in this Slurm job: the ``node``-th host of its het group's
    node list (the job's list for a single group); None outside Slurm."""
    var = (
        f"SLURM_JOB_NODELIST_HET_GROUP_{me.component}"
        if len(plan.components) > 1
        else "SLURM_JOB_NODELIST"
    )
    nodelist = environ.get(var)
    if not nodelist:
        return None
    hosts = expand_hostlist(nodelist)
    return (
        hosts[me.node] if me.node < len(hosts) else f"node {me.node} of {len(hosts)} ({nodelist})"
    )


def placement_problem(
    me: RankPlacement,
    plan: WorldPlan,
    facts: RankFacts,
    started_as: int | None,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """One line saying how this rank is not where the plan put it, or None. ``started_as``: the rank its
    launcher announced before MPI started (its GPUs were chosen for that rank)."""
    who = f"rank {me.rank} ({me.role} {me.group_rank})"
    if started_as is not None and started_as != me.rank:
        return (
            f"{who} was announced as rank {started_as} before MPI started, so it bound rank {started_as}'s "
            f"GPUs: the launcher's numbering ({'/'.join(LAUNCHER_RANK_VARS)}) differs from MPI's"
        )
    expected = planned_host(me, plan, environ)
    if expected is not None and expected != facts.host:
        return (
            f"{who} runs on {facts.host} but the plan puts it on node {me.node} of het group {me.component}, "
            f"{expected}: srun placed it otherwise (check the batch script's srun line against plan.json)"
        )
    if facts.gpu_count is not None and facts.gpu_count != len(me.gpus):
        return (
            f"{who} on {facts.host} sees {facts.gpu_count} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{facts.cuda_visible_devices}) but the plan gives it {len(me.gpus)} (local GPUs {list(me.gpus)})"
        )
    exclusive = [m for m in facts.compute_modes if m.lower().startswith("exclusive")]
    if exclusive:
        return (
            f"{who} on {facts.host} shares its GPU(s) {facts.cuda_visible_devices} with other roles (plan.json), "
            f"but their compute mode is {exclusive[0]}: one process per GPU, so colocated roles and CUDA IPC "
            "fail; ask the site for the Default compute mode or give the roles GPUs of their own (roles.*.devices)"
        )
    want = plan.components[me.component].cpus_per_task
    if facts.cpu_bound and len(facts.cpus) < want:
        return (
            f"{who} on {facts.host} is bound to {len(facts.cpus)} core(s) {list(facts.cpus)} but the plan "
            f"gives it {want} (srun --cpus-per-task): its threads and the processes it starts would share them"
        )
    return None
