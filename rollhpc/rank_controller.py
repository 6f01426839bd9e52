"""What rank 0 runs once the world has formed: the controller's runtime over the MPI channel, the workers built
in turns, the pipeline run; a signal or any failure becomes one report (RUN_DIR/error.json, the verdict of
``rollhpc.controller.failure``, and an exit status the batch script acts on).

``rollhpc.rank`` imports it on rank 0 alone: the run loop and the checkpoints it loads import torch, which the
worker ranks of a model-free role must not wait for.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import NoReturn

from mpi4py import MPI

from rollhpc import config as config_mod
from rollhpc.checkpoint.disk_space import OutOfSpace, out_of_space, raised_out_of_space
from rollhpc.checkpoint.storage import CheckpointStore
from rollhpc.config import CONTROLLER_ROLE
from rollhpc.controller.colocation import colocation_of, offload_after_startup
from rollhpc.controller.errors import WorkerDied, WorldNotFormed
from rollhpc.controller.failure import Failure, StalledCall, classify
from rollhpc.controller.mpi_stall import MpiStallWatch
from rollhpc.controller.run_loop import Outcome
from rollhpc.controller.runtime import Controller, RankInfo
from rollhpc.controller.startup import build_in_turns, startup_turns
from rollhpc.controller.worker_group import WorkerGroup
from rollhpc.launch.mpi_init_guard import MpiInitGuard
from rollhpc.launch.requeue import EXIT_REQUEUE, EXIT_WORKER_LOST, unresponsive_nodes
from rollhpc.placement.device_mapping import WorldPlan
from rollhpc.proc.startup_gc import startup_gc
from rollhpc.protocol.pipeline import Pipeline, RunContext
from rollhpc.rank_runtime import FormedWorld, WorldMember
from rollhpc.rundir import RunPaths, atomic_write_json, read_jsonl
from rollhpc.rundir.failure_kind import FailureKind
from rollhpc.rundir.records import (
    record_controller_exit,
    record_failed_node,
    record_startup_failure,
    write_error,
)
from rollhpc.transport.mpi_channel import MpiChannel
from rollhpc.transport.rendezvous import rendezvous_host
from rollhpc.transport.sideband import ControllerSideband

log = logging.getLogger("rollhpc")


class _Terminated(BaseException):
    """A signal to the controller, raised in its main thread wherever that happens to be. A BaseException
    (like KeyboardInterrupt) so that no `except Exception` on the way swallows it: logging's handleError
    does, when SIGINT lands inside a log handler's emit, and the controller would sleep on unreported."""


_reporting_failure = False  # set first thing on the controller's failure path
# held by the thread reporting the failure (the main one, or the MPI stall watch)
_failing = threading.Lock()


def _on_signal(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
    # Launchers may signal twice (mpiexec.gforker passes on an interrupt and adds its own when a rank dies):
    # a second one must not cut short the report of the first failure. The flag is set here, not first
    # thing in the report: a second signal landing between this raise and the report would cut it short.
    global _reporting_failure
    if not _reporting_failure:
        _reporting_failure = True
        raise _Terminated(
            f"run interrupted: the controller received signal {signal.Signals(signum).name}"
        )


def _write_error(run_dir: Path, exc: BaseException) -> str:
    summary = getattr(exc, "summary", "") or f"{type(exc).__name__}: {exc}"
    details = getattr(exc, "details", "") or "".join(traceback.format_exception(exc))
    write_error(RunPaths(run_dir).error, summary, type(exc).__name__, details)
    return summary


def _last_step(run_dir: Path) -> int | None:
    """The last step metrics.jsonl records (the step a failure came after), None before the first."""
    records = read_jsonl(RunPaths(run_dir).metrics)
    return records[-1].get("step") if records else None


def _broadcast_roles(
    fanout: dict[str, MPI.Intracomm], plan: WorldPlan, everyone: list[WorldMember], mode: str
) -> dict[str, MPI.Intracomm]:
    """The fanout communicators of the roles whose one-to-all payloads go as broadcasts (ControllerConfig.one_to_all);
    "auto" compares machines by host name, which is also what MPI's shared-memory transport goes by."""
    if mode == "p2p":
        return {}
    machines = {role: {everyone[r].hostname for r in plan.ranks_of(role)} for role in fanout}
    return {
        role: c
        for role, c in fanout.items()
        if mode == "broadcast" or machines[role] - {everyone[0].hostname}
    }


def _record_world(run_dir: Path, everyone: list[WorldMember]) -> None:
    """RUN_DIR/world.json: where every rank of the formed world runs."""
    atomic_write_json(
        RunPaths(run_dir).world,
        [
            {
                "rank": r,
                "role": e.role,
                "host": e.host,
                "pid": e.pid,
                "cuda_visible_devices": e.gpus,
                "cpus": list(e.cpus),
            }
            for r, e in enumerate(everyone)
        ],
    )


def _open_sideband(everyone: list[WorldMember]) -> ControllerSideband:
    if {e.hostname for e in everyone} == {socket.gethostname()}:
        return ControllerSideband("127.0.0.1")
    # workers on other machines reach the controller by its host name
    return ControllerSideband("", advertise=rendezvous_host(fallback=socket.getfqdn()))


def _open_controller(world: FormedWorld, guard: MpiInitGuard) -> Controller:
    """The formed world recorded (world.json), the sideband opened and its address given to every rank, signals
    turned into reported failures, and the controller runtime over the MPI channel."""
    comm, fanout, plan, run_dir, everyone = (
        world.comm,
        world.fanout,
        world.plan,
        world.run_dir,
        world.everyone,
    )
    _record_world(run_dir, everyone)
    sideband = _open_sideband(everyone)
    comm.bcast(sideband.address, root=0)
    guard.world_formed()  # the remaining start-up waits have their own time limits
    # from here a signal becomes a reported failure; before, the default action ended the rank (mpi_init_guard)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    ranks = {
        p.rank: RankInfo(p.rank, p.role, p.group_rank, everyone[p.rank].host, everyone[p.rank].pid)
        for p in plan.ranks
        if p.role != CONTROLLER_ROLE
    }
    c = world.cfg.controller
    broadcast = _broadcast_roles(fanout, plan, everyone, c.one_to_all)
    # roles on this machine: one shared-memory copy
    shared = (
        {role: list(plan.ranks_of(role)) for role in fanout if role not in broadcast}
        if c.one_to_all == "auto"
        else {}
    )
    return Controller(
        MpiChannel(comm, fanout=broadcast, shared=shared),
        sideband,
        ranks,
        run_dir,
        c.call_timeout_s,
        c.stack_dump_timeout_s,
        c.reply_tree_min_ranks,
        c.reply_fan_in,
    )


class _FailureReport:
    """Report the run's failure once (whichever thread comes first) and end the process. What it was (a lost
    worker, a lost peer, an error of the run's own) is decided after a bounded look at the workers' liveness and
    Slurm's view of the nodes (rollhpc.controller.failure), not by which error came first."""

    def __init__(self, world: FormedWorld, ctl: Controller) -> None:
        self.comm, self.ctl, self.cfg, self.run_dir, self.everyone = (
            world.comm,
            ctl,
            world.cfg,
            world.run_dir,
            world.everyone,
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

    def _classify(self, e: BaseException) -> tuple[BaseException, Failure]:
        ctl, run_dir = self.ctl, self.run_dir
        if isinstance(e, _Terminated):
            e = ctl.root_cause(e)  # some launchers interrupt every rank when one dies
            if not isinstance(e, WorkerDied):
                return e, Failure(FailureKind.INTERRUPTED, str(e), step=_last_step(run_dir))
        others = sorted({m.host for m in self.everyone} - {self.everyone[0].host})
        e, verdict = classify(
            e,
            ctl.dead_worker,
            lambda: unresponsive_nodes(others),
            lambda h: [f"rank {r.rank} {r.role}" for r in ctl.ranks.values() if r.host == h],
            settle_s=self.cfg.controller.peer_loss_settle_s,
            step=_last_step(run_dir),
        )
        return _disk_full(e, verdict, run_dir)

    def _record(self, e: BaseException, verdict: Failure) -> int:
        """The verdict in the run directory for the batch script's decision; the exit status that says it."""
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
            record_startup_failure(self.run_dir, self.everyone[0].host, verdict.summary)
        record_controller_exit(self.run_dir, status, verdict.record())
        return status


def _disk_full(e: BaseException, verdict: Failure, run_dir: Path) -> tuple[BaseException, Failure]:
    """An error of the run's own that is a write out of space or quota (a checkpoint's, or any other in the run
    directory, by a worker or the controller): told as that, with the filesystem's state and what continues the run
    (rollhpc.checkpoint.disk_space); any other verdict as it is."""
    if verdict.kind != FailureKind.ERROR:
        return e, verdict
    if not isinstance(e, OutOfSpace):
        if not raised_out_of_space(e):
            return e, verdict
        store = CheckpointStore(RunPaths(run_dir).checkpoints)
        e = out_of_space(store, run_dir, "a write in the run directory")
    return e, Failure(FailureKind.DISK_FULL, e.summary, step=verdict.step)


def _start_workers(
    ctl: Controller, world: FormedWorld, pipeline: Pipeline, workers: dict[str, WorkerGroup]
) -> dict[str, list[str]]:
    """The workers built, roles that share GPUs in turns (rollhpc.controller.startup), the pipeline's own
    start-up overlapping the first turn; with offload on, each turn's colocated roles give up their GPU
    memory before the next loads. Returns role -> parts offloaded at start."""
    cfg = world.cfg

    def setup() -> None:
        with startup_gc():
            pipeline.setup()  # the controller's own start-up, while the workers build theirs

    between: Callable[[list[str]], dict[str, list[str]]] | None = None
    if getattr(cfg.pipeline.options, "offload", False) and pipeline.memory_stages:
        colocation = colocation_of(cfg.roles)

        def between(turn: list[str]) -> dict[str, list[str]]:
            return offload_after_startup(workers, pipeline.memory_stages, colocation, turn)

    return build_in_turns(
        ctl,
        world.plan.ranks_of,
        startup_turns(cfg.roles),
        world.run_dir,
        cfg.controller.startup_timeout_s,
        between,
        setup,
    )


def _await_world(ctl: Controller, timeout_s: float) -> None:
    """Every worker's sideband connection, or WorldNotFormed."""
    try:
        ctl.sideband.accept(set(ctl.ranks), timeout_s)
    except TimeoutError as e:
        raise WorldNotFormed(f"the MPI world did not form: {e} (controller.world_timeout_s)") from e


def _run_pipeline(ctl: Controller, world: FormedWorld) -> bool:
    """The worker groups and the pipeline built, the workers started, the pipeline run, the workers shut down;
    whether it stopped for a requeue."""
    cfg, plan, run_dir, everyone = world.cfg, world.plan, world.run_dir, world.everyone
    _await_world(ctl, cfg.controller.world_timeout_s)
    workers = {
        role: WorkerGroup(
            ctl,
            role,
            config_mod.import_spec(rc.worker, f"roles.{role}.worker"),
            plan.ranks_of(role),
            rc.layout(),
        )
        for role, rc in cfg.roles.items()
    }
    pipeline_cls = config_mod.import_object(cfg.pipeline.entry, "pipeline.entry")
    run_ctx = RunContext(run_dir, cfg.run.seed, cfg)
    pipeline = pipeline_cls(workers, run_ctx, cfg.pipeline.options)
    run_ctx.offloaded_at_start = _start_workers(ctl, world, pipeline, workers)
    log.info(
        "world of %d ranks up on %s: %s",
        len(everyone),
        ", ".join(sorted({e.host for e in everyone})),
        ", ".join(f"{n} x{r.procs}" for n, r in cfg.roles.items()),
    )
    requeue = pipeline.run() is Outcome.STOPPED_FOR_REQUEUE
    ctl.shutdown(cfg.controller.shutdown_timeout_s)
    log.info("run stopped after a checkpoint, for a requeue" if requeue else "run finished")
    return requeue


def run_controller(world: FormedWorld, guard: MpiInitGuard) -> int:
    cfg = world.cfg
    ctl = _open_controller(world, guard)
    fail = _FailureReport(world, ctl)

    def on_mpi_stall(stuck_s: float) -> None:  # the watcher's thread: the main one is stuck in MPI
        fail(
            StalledCall(
                f"an MPI call on the controller has not returned for {stuck_s:.0f} s (a peer that is gone, "
                "or a broken network): the run is ended"
            )
        )

    stall_watch = MpiStallWatch(ctl.channel, on_mpi_stall, cfg.controller.mpi_stall_s).start()
    try:
        requeue = _run_pipeline(ctl, world)
    except BaseException as e:  # noqa: BLE001 - every failure ends the whole run, with one message
        fail(e)
    stall_watch.stop()
    status = EXIT_REQUEUE if requeue else 0
    record_controller_exit(world.run_dir, status)
    MPI.Finalize()
    return status
