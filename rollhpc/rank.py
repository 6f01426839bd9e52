"""What every MPI rank runs: ``python -m rollhpc.rank RUN_DIR ROLE``.

The launcher (``rollhpc train`` locally, ``srun`` on Slurm) starts one MPMD world; rank 0 is the
controller, every other rank serves one role. Start-up: agree on who is who (allgather), open
the sideband, build the workers, run the pipeline, shut down, or on any failure write
RUN_DIR/error.json, make every rank exit, and leave with a non-zero status.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

import yaml

from rollhpc import config as config_mod
from rollhpc.config import CONTROLLER_ROLE, ExperimentConfig
from rollhpc.launch.console import adopt_console
from rollhpc.launch.mpi_init_guard import MpiInitGuard
from rollhpc.placement.binding import bind_gpus, launcher_rank, observe, placement_problem
from rollhpc.placement.device_mapping import WorldPlan
from rollhpc.proc.mpi_fabric import provider_for_mpi_init
from rollhpc.proc.mpi_shm import remove_stale_segments
from rollhpc.proc.parent_death import die_with_parent, forked_children_die_with_us
from rollhpc.rundir import RunPaths, atomic_write_json
from rollhpc.rundir.failure_kind import FailureKind
from rollhpc.rundir.records import this_host, write_error
from rollhpc.testing import fault_injection

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
    import faulthandler

    faulthandler.enable(file=sys.stderr if rank else open(path, "a"), all_threads=True)


def _write_error(run_dir: Path, exc: BaseException) -> str:
    summary = getattr(exc, "summary", "") or f"{type(exc).__name__}: {exc}"
    details = getattr(exc, "details", "") or "".join(traceback.format_exception(exc))
    write_error(RunPaths(run_dir).error, summary, type(exc).__name__, details)
    return summary


def _last_step(run_dir: Path) -> int | None:
    """The last step metrics.jsonl records (the step a failure came after), None before the first."""
    from rollhpc.rundir import read_jsonl

    records = read_jsonl(RunPaths(run_dir).metrics)
    return records[-1].get("step") if records else None


class _Terminated(BaseException):
    """A signal to the controller, raised in its main thread wherever that happens to be. A BaseException
    (like KeyboardInterrupt) so that no `except Exception` on the way swallows it: logging's handleError
    did, when SIGINT landed inside a log handler's emit, and the controller slept on unreported."""


_reporting_failure = False  # set first thing on the controller's failure path
# held by the thread reporting the failure (the main one, or the MPI stall watch)
_failing = threading.Lock()


def _on_signal(signum, frame):  # noqa: ARG001
    # Launchers may signal twice (mpiexec.gforker passes on an interrupt and adds its own when a rank dies):
    # a second one must not cut short the report of the first failure. The flag is set here, not first
    # thing in fail(): a second signal landing between this raise and fail() cut the report short.
    global _reporting_failure
    if not _reporting_failure:
        _reporting_failure = True
        raise _Terminated(
            f"run interrupted: the controller received signal {signal.Signals(signum).name}"
        )


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
    for signum in (
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGINT,
    ):
        signal.signal(signum, signal.SIG_DFL)
    raw = yaml.safe_load(RunPaths(run_dir).config.read_text())
    # the guard comes first: loading the config imports the worker classes, and with them mpi4py (MPI_Init);
    # its limit is read from the controller section alone, which imports nothing
    controller = config_mod.from_dict(
        config_mod.ControllerConfig, raw.get("controller"), "config.controller"
    )
    guard = MpiInitGuard(run_dir, controller.world_timeout_s, expected_role)
    fault_injection.mpi_stall("mpi_init")
    # MPI shared memory that killed ranks of an earlier attempt left
    stale = remove_stale_segments()
    if stale:
        print(
            f"rollhpc: removed MPI shared memory left by an earlier attempt: {', '.join(stale)}",
            file=sys.stderr,
            flush=True,
        )
    plan = WorldPlan.load(RunPaths(run_dir).plan)
    # GPUs first: a CUDA-aware MPI initialises CUDA inside MPI_Init (rollhpc.placement.binding)
    started_as = launcher_rank()
    gpus = (
        bind_gpus(plan.ranks[started_as].gpus)
        if started_as is not None and started_as < plan.world_size
        else None
    )
    with provider_for_mpi_init():
        from mpi4py import MPI

    guard.mpi_initialized()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    me = plan.ranks[rank] if rank < plan.world_size else None
    my_role = me.role if me else "unplanned"
    set_role_environment(raw, my_role)  # before the role's modules load
    # the roles' modules: imports under the guard's limit, until the world formed
    cfg = config_mod.load(raw)
    fault_injection.mpi_stall("collectives")
    _setup_logging(run_dir, rank, my_role)
    if comm.Get_size() != plan.world_size or (expected_role and expected_role != my_role):
        print(
            f"rollhpc: rank {rank}: the MPI world ({comm.Get_size()} ranks, this one started as "
            f"{expected_role!r}) does not match the plan ({plan.world_size} ranks, rank {rank} = {my_role!r})",
            file=sys.stderr,
            flush=True,
        )
        comm.Abort(2)
    # no launcher said which rank this is: bound after MPI_Init, which CUDA-aware MPIs ignore
    if started_as is None:
        log.warning(
            "rank %d: no %s before MPI started: GPUs bound after MPI_Init",
            rank,
            "/".join(("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")),
        )
        gpus = bind_gpus(me.gpus)
    facts = observe(this_host(), me, plan)
    problem = placement_problem(me, plan, facts, started_as)
    # MPI collectives cannot time out: if a rank never arrives, the others would wait forever (the guard
    # ends them at controller.world_timeout_s, until world_formed())
    everyone = comm.allgather(
        (my_role, facts.host, os.getpid(), gpus, socket.gethostname(), facts.cpus, problem)
    )
    misplaced = [e[6] for e in everyone if e[6]]
    if misplaced:  # every rank sees the same list: all stop before any model loads
        return _stop_misplaced(comm, run_dir, rank, misplaced)
    role_names = [CONTROLLER_ROLE, *cfg.roles]
    role_comm = comm.Split(color=role_names.index(my_role), key=me.group_rank)
    # per role, the controller and the role's ranks: one-to-all payloads go out as one broadcast over it
    fanout = {
        role: comm.Split(color=0 if rank == 0 or role == my_role else MPI.UNDEFINED, key=rank)
        for role in cfg.roles
    }
    if rank == 0:
        return _run_controller(comm, fanout, cfg, plan, run_dir, everyone, guard)
    # Workers leave interrupts to the controller: a launcher that interrupts every rank when one dies
    # (mpiexec.gforker) must not turn a worker's death into a flood of KeyboardInterrupt errors.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _run_worker(comm, role_comm, fanout[my_role], cfg, run_dir, me, guard)


def _stop_misplaced(comm, run_dir: Path, rank: int, misplaced: list[str]) -> int:  # noqa: ANN001
    """Ranks not where the plan put them end the run, every rank at once: rank 0 says why (error.json, the
    controller's exit record: not restartable, the same srun line would place them the same way)."""
    from mpi4py import MPI

    if rank == 0:
        from rollhpc.controller.failure import Failure
        from rollhpc.rundir.records import record_controller_exit

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
    return 1


def _run_worker(
    comm, role_comm, fanout, cfg: ExperimentConfig, run_dir: Path, me, guard: MpiInitGuard
) -> int:
    from rollhpc.transport.mpi_channel import MpiChannel
    from rollhpc.transport.sideband import WorkerSideband
    from rollhpc.protocol.worker import WorkerContext
    from rollhpc.workers.serve import serve

    role, rank = me.role, me.rank
    address = comm.bcast(None, root=0)
    sideband = WorkerSideband(address, rank)
    guard.world_formed()  # from here the sideband ends this process if the controller goes
    rc = cfg.roles[role]
    ctx = WorkerContext(
        role=role,
        world_rank=rank,
        coords=rc.layout().coords(me.group_rank),
        group_size=rc.procs,
        role_comm=role_comm,
        run_dir=run_dir,
        seed=cfg.run.seed,
        layout=rc.layout(),
    )
    worker_cls = config_mod.import_object(rc.worker, f"roles.{role}.worker")
    serve(MpiChannel(comm, my_fanout=fanout), sideband, worker_cls, ctx, rc.options)
    from mpi4py import MPI

    MPI.Finalize()
    return 0


def _broadcast_roles(fanout: dict, plan, everyone, mode: str) -> dict:
    """The fanout communicators of the roles whose one-to-all payloads go as broadcasts (ControllerConfig.one_to_all);
    "auto" compares machines by host name, which is also what MPI's shared-memory transport goes by."""
    if mode == "p2p":
        return {}
    machines = {role: {everyone[r][4] for r in plan.ranks_of(role)} for role in fanout}
    return {
        role: c
        for role, c in fanout.items()
        if mode == "broadcast" or machines[role] - {everyone[0][4]}
    }


def _open_controller(
    comm,
    fanout,
    cfg: ExperimentConfig,
    plan,
    run_dir: Path,
    everyone,  # noqa: ANN001
    guard: MpiInitGuard,
):  # noqa: ANN202 - a Controller (imported lazily)
    """The formed world recorded (world.json), the sideband opened and its address given to every rank, signals
    turned into reported failures, and the controller runtime over the MPI channel."""
    from rollhpc.controller.runtime import Controller, RankInfo
    from rollhpc.transport.mpi_channel import MpiChannel
    from rollhpc.transport.rendezvous import rendezvous_host
    from rollhpc.transport.sideband import ControllerSideband

    atomic_write_json(
        RunPaths(run_dir).world,
        [
            {
                "rank": r,
                "role": e[0],
                "host": e[1],
                "pid": e[2],
                "cuda_visible_devices": e[3],
                "cpus": list(e[5]),
            }
            for r, e in enumerate(everyone)
        ],
    )
    if {e[4] for e in everyone} == {socket.gethostname()}:
        sideband = ControllerSideband("127.0.0.1")
    else:  # workers on other machines reach the controller by its host name
        sideband = ControllerSideband("", advertise=rendezvous_host(fallback=socket.getfqdn()))
    comm.bcast(sideband.address, root=0)
    guard.world_formed()  # the remaining start-up waits have their own time limits
    # from here a signal becomes a reported failure; before, the default action ended the rank (mpi_init_guard)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    ranks = {
        p.rank: RankInfo(p.rank, p.role, p.group_rank, everyone[p.rank][1], everyone[p.rank][2])
        for p in plan.ranks
        if p.role != CONTROLLER_ROLE
    }
    broadcast = _broadcast_roles(fanout, plan, everyone, cfg.controller.one_to_all)
    # roles on this machine: one shared-memory copy
    shared = (
        {role: list(plan.ranks_of(role)) for role in fanout if role not in broadcast}
        if cfg.controller.one_to_all == "auto"
        else {}
    )
    return Controller(
        MpiChannel(comm, fanout=broadcast, shared=shared),
        sideband,
        ranks,
        run_dir,
        cfg.controller.call_timeout_s,
        cfg.controller.stack_dump_timeout_s,
        cfg.controller.reply_tree_min_ranks,
        cfg.controller.reply_fan_in,
    )


class _FailureReport:
    """Report the run's failure once (whichever thread comes first) and end the process. What it was (a lost
    worker, a lost peer, an error of the run's own) is decided after a bounded look at the workers' liveness and
    Slurm's view of the nodes (rollhpc.controller.failure), not by which error came first."""

    def __init__(self, comm, ctl, cfg: ExperimentConfig, run_dir: Path, everyone) -> None:  # noqa: ANN001
        self.comm, self.ctl, self.cfg, self.run_dir, self.everyone = (
            comm,
            ctl,
            cfg,
            run_dir,
            everyone,
        )

    def __call__(self, e: BaseException) -> NoReturn:
        global _reporting_failure
        _failing.acquire()  # a second failure waits here for the first report's os._exit
        _reporting_failure = True
        if threading.current_thread() is threading.main_thread():
            # a second signal must not cut the report short
            for sig in (
                signal.SIGINT,
                signal.SIGTERM,
            ):
                signal.signal(sig, signal.SIG_IGN)
        e, verdict = self._classify(e)
        summary = _write_error(self.run_dir, e)
        log.error("run failed: %s", summary)
        if getattr(e, "details", ""):
            log.error("%s", e.details.rstrip())
        elif not hasattr(e, "summary"):
            log.error("%s", "".join(traceback.format_exception(e)).rstrip())
        status = self._record(e, verdict)
        for h in logging.getLogger().handlers:
            h.flush()
        if not self.ctl.release():
            self.comm.Abort(status)
        os._exit(status)

    def _classify(self, e: BaseException):  # noqa: ANN202
        from rollhpc.controller.errors import WorkerDied
        from rollhpc.controller.failure import Failure, classify
        from rollhpc.launch.requeue import unresponsive_nodes

        ctl, run_dir = self.ctl, self.run_dir
        if isinstance(e, _Terminated):
            e = ctl.root_cause(e)  # some launchers interrupt every rank when one dies
            if not isinstance(e, WorkerDied):
                return e, Failure(FailureKind.INTERRUPTED, str(e), step=_last_step(run_dir))
        others = sorted({h for _, h, *_ in self.everyone} - {self.everyone[0][1]})
        return classify(
            e,
            ctl.dead_worker,
            lambda: unresponsive_nodes(others),
            lambda h: [f"rank {r.rank} {r.role}" for r in ctl.ranks.values() if r.host == h],
            settle_s=self.cfg.controller.peer_loss_settle_s,
            step=_last_step(run_dir),
        )

    def _record(self, e: BaseException, verdict) -> int:  # noqa: ANN001
        """The verdict in the run directory for the batch script's decision; the exit status that says it."""
        from rollhpc.launch.requeue import EXIT_WORKER_LOST
        from rollhpc.rundir.records import (
            record_controller_exit,
            record_failed_node,
            record_startup_failure,
        )

        status = EXIT_WORKER_LOST if verdict.restartable else 1
        log.error(
            "failure classified as %s%s",
            verdict.kind,
            "" if verdict.restartable else ": not restartable (a restart would meet it again)",
        )
        # restartable: a requeue on other nodes may well succeed
        if verdict.kind == FailureKind.LOST_WORKER:
            for host in verdict.hosts:
                record_failed_node(
                    self.run_dir, host, e.summary if hasattr(e, "summary") else str(e)
                )
        # restartable: which node is at fault is unknown
        elif verdict.kind == FailureKind.WORLD_NOT_FORMED:
            record_startup_failure(self.run_dir, self.everyone[0][1], verdict.summary)
        record_controller_exit(self.run_dir, status, verdict.record())
        return status


def _start_workers(
    ctl, cfg: ExperimentConfig, plan, run_dir: Path, pipeline, workers: dict
) -> dict:  # noqa: ANN001
    """The workers built, roles that share GPUs in turns (rollhpc.controller.startup), the pipeline's own
    start-up overlapping the first turn; with offload on, each turn's colocated roles give up their GPU
    memory before the next loads. Returns role -> parts offloaded at start."""
    from rollhpc.controller.colocation import colocation_of, offload_after_startup
    from rollhpc.controller.startup import build_in_turns, startup_turns
    from rollhpc.proc.startup_gc import startup_gc

    def setup() -> None:
        with startup_gc():
            pipeline.setup()  # the controller's own start-up, while the workers build theirs

    between = None
    if getattr(cfg.pipeline.options, "offload", False) and pipeline.memory_stages:
        colocation = colocation_of(cfg.roles)

        def between(turn: list[str]) -> dict[str, list[str]]:
            return offload_after_startup(workers, pipeline.memory_stages, colocation, turn)

    return build_in_turns(
        ctl,
        plan.ranks_of,
        startup_turns(cfg.roles),
        run_dir,
        cfg.controller.startup_timeout_s,
        between,
        setup,
    )


def _run_controller(
    comm, fanout, cfg: ExperimentConfig, plan, run_dir: Path, everyone, guard: MpiInitGuard
) -> int:
    from rollhpc.controller.errors import WorldNotFormed
    from rollhpc.controller.failure import StalledCall
    from rollhpc.controller.mpi_stall import MpiStallWatch
    from rollhpc.protocol.pipeline import RunContext
    from rollhpc.controller.run_loop import Outcome
    from rollhpc.controller.worker_group import WorkerGroup
    from rollhpc.launch.requeue import EXIT_REQUEUE
    from rollhpc.rundir.records import record_controller_exit

    ctl = _open_controller(comm, fanout, cfg, plan, run_dir, everyone, guard)
    fail = _FailureReport(comm, ctl, cfg, run_dir, everyone)

    def on_mpi_stall(stuck_s: float) -> None:  # the watcher's thread: the main one is stuck in MPI
        fail(
            StalledCall(
                f"an MPI call on the controller has not returned for {stuck_s:.0f} s (a peer that is gone, "
                "or a broken network): the run is ended"
            )
        )

    stall_watch = MpiStallWatch(ctl.channel, on_mpi_stall, cfg.controller.mpi_stall_s).start()
    try:
        try:
            ctl.sideband.accept(set(ctl.ranks), cfg.controller.world_timeout_s)
        except TimeoutError as e:
            raise WorldNotFormed(
                f"the MPI world did not form: {e} (controller.world_timeout_s)"
            ) from e
        workers = {
            role: WorkerGroup(
                ctl,
                role,
                config_mod.import_object(rc.worker, role),
                plan.ranks_of(role),
                rc.layout(),
            )
            for role, rc in cfg.roles.items()
        }
        pipeline_cls = config_mod.import_object(cfg.pipeline.entry, "pipeline.entry")
        run_ctx = RunContext(run_dir, cfg.run.seed, cfg)
        pipeline = pipeline_cls(workers, run_ctx, cfg.pipeline.options)
        run_ctx.offloaded_at_start = _start_workers(ctl, cfg, plan, run_dir, pipeline, workers)
        log.info(
            "world of %d ranks up on %s: %s",
            len(everyone),
            ", ".join(sorted({e[1] for e in everyone})),
            ", ".join(f"{n} x{r.procs}" for n, r in cfg.roles.items()),
        )
        requeue = pipeline.run() is Outcome.STOPPED_FOR_REQUEUE
        ctl.shutdown(cfg.controller.shutdown_timeout_s)
        log.info("run stopped after a checkpoint, for a requeue" if requeue else "run finished")
    except BaseException as e:  # noqa: BLE001 - every failure ends the whole run, with one message
        fail(e)
    stall_watch.stop()
    from mpi4py import MPI

    status = EXIT_REQUEUE if requeue else 0
    record_controller_exit(run_dir, status)
    MPI.Finalize()
    return status


if __name__ == "__main__":
    sys.exit(main())
