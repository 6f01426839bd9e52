"""What every MPI rank runs: ``python -m rollhpc.rank RUN_DIR ROLE``.

The launcher (``rollhpc train`` locally, ``srun`` on Slurm) starts one MPMD world; rank 0 is the
controller, every other rank serves one role. Start-up: agree on who is who (allgather), open
the sideband, build the workers, run the pipeline, shut down, or on any failure write
RUN_DIR/error.json, make every rank exit, and leave with a non-zero status.

This module holds what comes before ``MPI_Init``: the start-up guard, the GPUs bound, then MPI started, the
role's environment set and the config loaded; ``rollhpc.rank_runtime`` (imported after that) forms the world
and runs a worker, ``rollhpc.rank_controller`` the controller.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from rollhpc import config as config_mod
from rollhpc.launch.console import adopt_console
from rollhpc.launch.mpi_init_guard import MpiInitGuard
from rollhpc.placement.binding import LAUNCHER_RANK_VARS, bind_gpus, launcher_rank
from rollhpc.placement.device_mapping import RankPlacement, WorldPlan
from rollhpc.proc.mpi_fabric import provider_for_mpi_init
from rollhpc.proc.mpi_shm import remove_stale_segments
from rollhpc.proc.parent_death import die_with_parent, forked_children_die_with_us
from rollhpc.rundir import RunPaths
from rollhpc.testing import fault_injection

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger("rollhpc")


def _setup_logging(run_dir: Path, rank: int, role: str) -> None:
    logs = RunPaths(run_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / (f"rank{rank}-{role}.log")
    fmt = logging.Formatter(
        f"%(asctime)s [{role}:{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"
    )
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    if rank == 0:
        for h in (logging.StreamHandler(sys.stderr), logging.FileHandler(path)):
            h.setFormatter(fmt)
            root.addHandler(h)
    else:
        # workers write everything, prints and native output included, to their own file
        f = open(path, "a", buffering=1)
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
        h = logging.StreamHandler(f)
        h.setFormatter(fmt)
        root.addHandler(h)
    faulthandler.enable(file=sys.stderr if rank else open(path, "a"), all_threads=True)


def set_role_environment(raw: dict, role: str) -> None:
    """Put ``roles.ROLE.env_vars`` of the run's config (checked when the launcher loaded it) into this process's
    environment: done before torch loads, whose OpenMP runtime reads OMP_* once, at load."""
    env = ((raw.get("roles") or {}).get(role) or {}).get("env_vars") or {}
    os.environ.update({str(k): str(v) for k, v in env.items()})


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    return run_rank(Path(args[0]), args[1] if len(args) > 1 else None)


def run_rank(run_dir: Path, expected_role: str | None = None) -> int:
    """Join the world described by RUN_DIR/plan.json and play this rank's part in it."""
    adopt_console()  # a local world: write to the launcher's console, not through mpiexec's pipes
    die_with_parent()  # if our parent (mpiexec's proxy, srun's stepd) dies, so do we
    forked_children_die_with_us()  # and whatever a library forks under us dies with us
    # until the world forms, a step's end ends us
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    raw = yaml.safe_load(RunPaths(run_dir).config.read_text())
    guard = _start_guard(run_dir, raw, expected_role)
    _remove_stale_shared_memory()
    plan = WorldPlan.load(RunPaths(run_dir).plan)
    # GPUs first: a CUDA-aware MPI initialises CUDA inside MPI_Init (rollhpc.placement.binding)
    started_as = launcher_rank()
    gpus = (
        bind_gpus(plan.ranks[started_as].gpus)
        if started_as is not None and started_as < plan.world_size
        else None
    )
    comm = _start_mpi(guard)
    rank = comm.Get_rank()
    me = plan.ranks[rank] if rank < plan.world_size else None
    my_role = me.role if me else "unplanned"
    set_role_environment(raw, my_role)  # before the role's modules load
    # the roles' modules: imports under the guard's limit, until the world formed
    cfg = config_mod.load(raw)
    fault_injection.mpi_stall("collectives")
    _setup_logging(run_dir, rank, my_role)
    _abort_unless_planned(comm, plan, expected_role, my_role)
    if started_as is None:
        gpus = _bind_after_mpi_init(rank, me)
    # after MPI_Init and the role's environment: it imports mpi4py's communicators and numpy
    from rollhpc import rank_runtime

    world = rank_runtime.form_world(comm, cfg, plan, run_dir, me, gpus, started_as)
    if world is None:
        return 1  # a rank was misplaced: every rank has stopped, rank 0 said why
    if rank == 0:
        # the controller's modules (run loop, pipelines, run checkpoints): loaded by rank 0 alone
        from rollhpc import rank_controller

        return rank_controller.run_controller(world, guard)
    return rank_runtime.run_worker(world, me, guard)


def _start_guard(run_dir: Path, raw: dict, expected_role: str | None) -> MpiInitGuard:
    """The guard comes first: loading the config imports the workers' specs (a worker without one, its class),
    which may import mpi4py (MPI_Init); its limit is read from the controller section alone, which imports
    nothing."""
    controller = config_mod.from_dict(
        config_mod.ControllerConfig, raw.get("controller"), "config.controller"
    )
    guard = MpiInitGuard(run_dir, controller.world_timeout_s, expected_role)
    fault_injection.mpi_stall("mpi_init")
    return guard


def _remove_stale_shared_memory() -> None:
    """MPI shared memory that killed ranks of an earlier attempt left."""
    stale = remove_stale_segments()
    if stale:
        print(
            f"rollhpc: removed MPI shared memory left by an earlier attempt: {', '.join(stale)}",
            file=sys.stderr,
            flush=True,
        )


def _start_mpi(guard: MpiInitGuard) -> MPI.Intracomm:
    """MPI_Init, with the fabric's provider chosen for it; the world communicator."""
    with provider_for_mpi_init():
        # importing mpi4py runs MPI_Init: only here, once this rank's GPUs are bound
        from mpi4py import MPI

    guard.mpi_initialized()
    return MPI.COMM_WORLD


def _abort_unless_planned(
    comm: MPI.Intracomm, plan: WorldPlan, expected_role: str | None, my_role: str
) -> None:
    """End the world when it is not the plan's: another size, or this rank started as another role."""
    rank = comm.Get_rank()
    if comm.Get_size() != plan.world_size or (expected_role and expected_role != my_role):
        print(
            f"rollhpc: rank {rank}: the MPI world ({comm.Get_size()} ranks, this one started as "
            f"{expected_role!r}) does not match the plan ({plan.world_size} ranks, rank {rank} = {my_role!r})",
            file=sys.stderr,
            flush=True,
        )
        comm.Abort(2)


def _bind_after_mpi_init(rank: int, me: RankPlacement) -> str | None:
    """No launcher said which rank this is: bound after MPI_Init, which CUDA-aware MPIs ignore."""
    log.warning(
        "rank %d: no %s before MPI started: GPUs bound after MPI_Init",
        rank,
        "/".join(LAUNCHER_RANK_VARS),
    )
    return bind_gpus(me.gpus)


if __name__ == "__main__":
    sys.exit(main())
