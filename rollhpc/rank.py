"""What every MPI rank runs: ``python -m rollhpc.rank RUN_DIR ROLE``.

The launcher (``rollhpc train`` locally, ``srun`` on Slurm) starts one MPMD world; rank 0 is the
controller, every other rank serves one role. Start-up: agree on who is who (allgather), open
the sideband, build the workers, run the pipeline, shut down, or on any failure write
RUN_DIR/error.json, make every rank exit, and leave with a non-zero status.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import yaml

from rollhpc import config as config_mod
from rollhpc.config import CONTROLLER_ROLE, ExperimentConfig

log = logging.getLogger("rollhpc")


def _die_with_parent() -> None:
    """Linux: if our parent (mpiexec's proxy, srun's stepd) dies, so do we: no orphans."""
    if os.environ.get("ROLLHPC_NO_PDEATHSIG"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _setup_logging(run_dir: Path, rank: int, role: str) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / (f"rank{rank}-{role}.log")
    fmt = logging.Formatter(f"%(asctime)s [{role}:{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
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
    tmp = run_dir / "error.json.tmp"
    tmp.write_text(json.dumps({"summary": summary, "type": type(exc).__name__, "details": details,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
    tmp.replace(run_dir / "error.json")
    return summary


def _startup_timed_out(run_dir: Path, rank: int, role: str, limit: float) -> None:
    msg = (f"start-up did not complete within {limit:g} s (controller.startup_timeout_s): some rank never "
           f"joined the MPI world; see the logs in {run_dir / 'logs'}")
    if rank == 0:
        _write_error(run_dir, RuntimeError(msg))
    print(f"rollhpc: rank {rank} ({role}): {msg}", file=sys.stderr, flush=True)
    os._exit(1)


class _Terminated(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    raise _Terminated(f"run interrupted: the controller received signal {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    run_dir_s, my_role = (argv or sys.argv[1:])[:2]
    run_dir = Path(run_dir_s)
    _die_with_parent()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    _setup_logging(run_dir, rank, my_role)
    cfg = config_mod.load(yaml.safe_load((run_dir / "config.yaml").read_text()))
    # MPI collectives cannot time out: if a rank never arrives, the others would wait forever.
    watchdog = threading.Timer(cfg.controller.startup_timeout_s, _startup_timed_out,
                               (run_dir, rank, my_role, cfg.controller.startup_timeout_s))
    watchdog.daemon = True
    watchdog.start()
    everyone = comm.allgather((my_role, socket.gethostname(), os.getpid()))
    expected = [CONTROLLER_ROLE] + [name for name, r in cfg.roles.items() for _ in range(r.procs)]
    got = [e[0] for e in everyone]
    if got != expected:
        if rank == 0:
            print(f"rollhpc: the MPI world does not match the config: ranks have roles {got}, "
                  f"the config asks for {expected}", file=sys.stderr, flush=True)
            comm.Abort(2)
        time.sleep(60)
    role_names = [CONTROLLER_ROLE, *cfg.roles]
    role_comm = comm.Split(color=role_names.index(my_role), key=rank)
    hosts = {e[1] for e in everyone}
    if rank == 0:
        return _run_controller(comm, cfg, run_dir, everyone, hosts, watchdog)
    # Workers leave interrupts to the controller: a launcher that interrupts every rank when one dies
    # (mpiexec.gforker) must not turn a worker's death into a flood of KeyboardInterrupt errors.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _run_worker(comm, role_comm, cfg, run_dir, my_role, rank, everyone, watchdog)


def _group_ranks(everyone: list[tuple[str, str, int]], role: str) -> list[int]:
    return [r for r, e in enumerate(everyone) if e[0] == role]


def _run_worker(comm, role_comm, cfg: ExperimentConfig, run_dir: Path, role: str, rank: int, everyone,
                watchdog: threading.Timer) -> int:
    from rollhpc.transport.mpi_channel import MpiChannel
    from rollhpc.transport.sideband import WorkerSideband
    from rollhpc.workers.base import WorkerContext
    from rollhpc.workers.serve import serve

    address = comm.bcast(None, root=0)
    sideband = WorkerSideband(address, rank)
    watchdog.cancel()  # from here the sideband ends this process if the controller goes
    rc = cfg.roles[role]
    group_rank = _group_ranks(everyone, role).index(rank)
    ctx = WorkerContext(role=role, world_rank=rank, coords=rc.layout().coords(group_rank), group_size=rc.procs,
                        role_comm=role_comm, run_dir=run_dir, seed=cfg.run.seed)
    worker_cls = config_mod.import_object(rc.worker, f"roles.{role}.worker")
    serve(MpiChannel(comm), sideband, worker_cls, ctx, rc.options)
    from mpi4py import MPI

    MPI.Finalize()
    return 0


def _run_controller(comm, cfg: ExperimentConfig, run_dir: Path, everyone, hosts: set[str],
                    watchdog: threading.Timer) -> int:
    from rollhpc.controller.errors import RunFailed
    from rollhpc.controller.pipeline import RunContext
    from rollhpc.controller.runtime import Controller, RankInfo
    from rollhpc.controller.worker_group import WorkerGroup
    from rollhpc.transport.mpi_channel import MpiChannel
    from rollhpc.transport.sideband import ControllerSideband

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    bind = "127.0.0.1" if hosts == {socket.gethostname()} else socket.gethostbyname(socket.gethostname())
    sideband = ControllerSideband(bind)
    comm.bcast(sideband.address, root=0)
    watchdog.cancel()  # the remaining start-up waits have their own time limits
    ranks = {}
    for role in cfg.roles:
        for g, r in enumerate(_group_ranks(everyone, role)):
            ranks[r] = RankInfo(r, role, g, everyone[r][1], everyone[r][2])
    ctl = Controller(MpiChannel(comm), sideband, ranks, run_dir, cfg.controller.call_timeout_s,
                     cfg.controller.stack_dump_timeout_s)
    try:
        sideband.accept(set(ranks), cfg.controller.startup_timeout_s)
        ctl.wait([(r, 0) for r in ranks], "worker start-up", cfg.controller.startup_timeout_s)
        log.info("world of %d ranks up on %s: %s", len(everyone), ", ".join(sorted(hosts)),
                 ", ".join(f"{n} x{r.procs}" for n, r in cfg.roles.items()))
        groups = {
            role: WorkerGroup(ctl, role, config_mod.import_object(rc.worker, role), _group_ranks(everyone, role),
                              rc.layout())
            for role, rc in cfg.roles.items()
        }
        pipeline_cls = config_mod.import_object(cfg.pipeline.entry, "pipeline.entry")
        pipeline_cls(groups, RunContext(run_dir, cfg.run.seed, cfg), cfg.pipeline.options).run()
        ctl.shutdown(cfg.controller.shutdown_timeout_s)
        log.info("run finished")
    except BaseException as e:  # noqa: BLE001 - every failure ends the whole run, with one message
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the report short
            signal.signal(sig, signal.SIG_IGN)
        if not isinstance(e, RunFailed):
            e = ctl.root_cause(e)
        summary = _write_error(run_dir, e)
        log.error("run failed: %s", summary)
        if getattr(e, "details", ""):
            log.error("%s", e.details.rstrip())
        elif not hasattr(e, "summary"):
            log.error("%s", "".join(traceback.format_exception(e)).rstrip())
        for h in logging.getLogger().handlers:
            h.flush()
        if not ctl.release():
            comm.Abort(1)
        os._exit(1)
    from mpi4py import MPI

    MPI.Finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
