"""What a rank runs once MPI has started (``rollhpc.rank`` imports this module after ``MPI_Init``): the world
formed (every rank's placement gathered and checked, the communicators split), and on every rank but the
controller (``rollhpc.rank_controller``) the role's worker serving calls.

Imports mpi4py, the transport and the worker's serve loop at the top: ``rollhpc.rank`` keeps what comes before
``MPI_Init`` (GPU binding, the role's environment) free of them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from mpi4py import MPI

from rollhpc import config as config_mod
from rollhpc.config import CONTROLLER_ROLE, ExperimentConfig
from rollhpc.controller.failure import Failure
from rollhpc.launch.mpi_init_guard import MpiInitGuard
from rollhpc.placement.binding import observe, placement_problem
from rollhpc.placement.device_mapping import RankPlacement, WorldPlan
from rollhpc.protocol.worker import WorkerContext
from rollhpc.rundir import RunPaths
from rollhpc.rundir.failure_kind import FailureKind
from rollhpc.rundir.records import record_controller_exit, this_host, write_error
from rollhpc.transport.mpi_channel import MpiChannel
from rollhpc.transport.sideband import WorkerSideband
from rollhpc.workers.serve import serve

log = logging.getLogger("rollhpc")


class WorldMember(NamedTuple):
    """One rank as every rank learns it from the start-up allgather."""

    role: str
    host: str  # as Slurm names the node (placement.binding.RankFacts.host)
    pid: int
    gpus: str | None  # its CUDA_VISIBLE_DEVICES
    hostname: str  # socket.gethostname(): what MPI's shared-memory transport goes by
    cpus: tuple[int, ...]
    # placement.binding.placement_problem's verdict, None where placed as planned
    problem: str | None


@dataclass(frozen=True)
class FormedWorld:
    """The world once every rank has reported: its communicators, config, plan and members."""

    comm: MPI.Intracomm
    fanout: dict[str, MPI.Intracomm]  # per role: the controller and the role's ranks
    cfg: ExperimentConfig
    plan: WorldPlan
    run_dir: Path
    everyone: list[WorldMember]  # by world rank
    role_comm: MPI.Intracomm  # this rank's role's ranks (the controller's: itself)


def form_world(
    comm: MPI.Intracomm,
    cfg: ExperimentConfig,
    plan: WorldPlan,
    run_dir: Path,
    me: RankPlacement,
    gpus: str | None,
    started_as: int | None,
) -> FormedWorld | None:
    """Every rank's placement gathered and the communicators split; None when a rank is not where the plan put
    it: then every rank has stopped (MPI finalized, rank 0 has said why)."""
    everyone = _gather(comm, me, plan, gpus, started_as)
    misplaced = [e.problem for e in everyone if e.problem]
    if misplaced:  # every rank sees the same list: all stop before any model loads
        _stop_misplaced(comm, run_dir, misplaced)
        return None
    role_comm, fanout = _split(comm, cfg, me)
    return FormedWorld(comm, fanout, cfg, plan, run_dir, everyone, role_comm)


def _gather(
    comm: MPI.Intracomm,
    me: RankPlacement,
    plan: WorldPlan,
    gpus: str | None,
    started_as: int | None,
) -> list[WorldMember]:
    """Every rank's placement and its problem, if any. MPI collectives cannot time out: if a rank never
    arrives, the others would wait forever (the guard ends them at controller.world_timeout_s, until
    world_formed())."""
    facts = observe(this_host(), me, plan)
    problem = placement_problem(me, plan, facts, started_as)
    mine = (me.role, facts.host, os.getpid(), gpus, socket.gethostname(), facts.cpus, problem)
    return [WorldMember(*e) for e in comm.allgather(mine)]


def _split(
    comm: MPI.Intracomm, cfg: ExperimentConfig, me: RankPlacement
) -> tuple[MPI.Intracomm, dict[str, MPI.Intracomm]]:
    """This rank's role communicator, and per role the fanout communicator of the controller and the role's
    ranks: one-to-all payloads go out as one broadcast over it (the null communicator on other ranks)."""
    rank = comm.Get_rank()
    role_names = [CONTROLLER_ROLE, *cfg.roles]
    role_comm = comm.Split(color=role_names.index(me.role), key=me.group_rank)
    fanout = {
        role: comm.Split(color=0 if rank == 0 or role == me.role else MPI.UNDEFINED, key=rank)
        for role in cfg.roles
    }
    return role_comm, fanout


def _stop_misplaced(comm: MPI.Intracomm, run_dir: Path, misplaced: list[str]) -> None:
    """Ranks not where the plan put them end the run, every rank at once: rank 0 says why (error.json, the
    controller's exit record: not restartable, the same srun line would place them the same way)."""
    if comm.Get_rank() == 0:
        more = (
            f" (and {len(misplaced) - 1} more rank(s): RUN_DIR/error.json lists them)"
            if len(misplaced) > 1
            else ""
        )
        summary = f"placement check: {misplaced[0]}{more}"
        write_error(RunPaths(run_dir).error, summary, "PlacementError", "\n".join(misplaced))
        log.error("run failed: %s", summary)
        record_controller_exit(run_dir, 1, Failure(FailureKind.PLACEMENT, summary).record())
    MPI.Finalize()


# ---------------------------------------------------------------------------------------------- a worker rank
def run_worker(world: FormedWorld, me: RankPlacement, guard: MpiInitGuard) -> int:
    """Serve the role's calls until the controller shuts the world down."""
    # Workers leave interrupts to the controller: a launcher that interrupts every rank when one dies
    # (mpiexec.gforker) must not turn a worker's death into a flood of KeyboardInterrupt errors.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    comm, cfg, role, rank = world.comm, world.cfg, me.role, me.rank
    address = comm.bcast(None, root=0)
    sideband = WorkerSideband(address, rank)
    guard.world_formed()  # from here the sideband ends this process if the controller goes
    rc = cfg.roles[role]
    ctx = WorkerContext(
        role=role,
        world_rank=rank,
        coords=rc.layout().coords(me.group_rank),
        group_size=rc.procs,
        role_comm=world.role_comm,
        run_dir=world.run_dir,
        seed=cfg.run.seed,
        layout=rc.layout(),
    )
    worker_cls = config_mod.import_object(rc.worker, f"roles.{role}.worker")
    serve(MpiChannel(comm, my_fanout=world.fanout[role]), sideband, worker_cls, ctx, rc.options)
    MPI.Finalize()
    return 0
