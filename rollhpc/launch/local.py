"""Local launch: one ``mpiexec`` MPMD command, rank 0 the controller, then each role's ranks.

mpiexec runs in its own session so that, whatever happens (worker crash, Ctrl-C, a failing
controller), everything it started is swept when it returns: no orphan processes.
MPICH's hydra launcher is avoided when the single-host ``mpiexec.gforker`` is there: when a rank is
SIGKILLed mid-run, hydra's proxy can crash on the dead rank's PMI socket and take every rank down
with it, so the controller never gets to say which worker died. gforker instead interrupts the
other ranks, which the controller turns into a report naming the dead worker (see rollhpc.rank).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rollhpc.config import ConfigError, ExperimentConfig
from rollhpc.config.cluster import ClusterConfig
from rollhpc.launch.console import console_for_ranks
from rollhpc.placement.device_mapping import WorldPlan, plan_world
from rollhpc.proc.mpi_shm import FANOUT_PREFIX, SHM_DIR
from rollhpc.proc.parent_death import die_with_parent
from rollhpc.rundir import RunPaths, atomic_write_json, atomic_write_text
from rollhpc.rundir.records import controller_exit


def find_mpiexec(setting: str) -> str:
    if setting != "auto":
        return setting
    for name in ("mpiexec.gforker", "mpiexec"):
        beside = Path(sys.executable).parent / name
        if beside.exists():
            return str(beside)
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found: install the `mpich` wheel in this environment or set launch.mpiexec"
        )
    return found


def local_gpu_count() -> int:
    """GPUs on this machine, without importing torch (nvidia-smi lists one per line)."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def local_plan(cfg: ExperimentConfig) -> WorldPlan:
    """This machine as a one-node cluster; CPUs may be oversubscribed (ranks mostly wait on each other)."""
    cluster = ClusterConfig(
        nodes=1,
        gpus_per_node=local_gpu_count(),
        cpus_per_node=max(
            os.cpu_count() or 1, sum(r.cpus_per_proc * r.procs for r in cfg.roles.values()) + 1
        ),
    )
    try:
        return plan_world(cfg, cluster)
    except ConfigError as e:
        raise ConfigError(f"cannot run on this machine ({cluster.gpus_per_node} GPUs): {e}") from e


def build_command(cfg: ExperimentConfig, plan: WorldPlan, run_dir: Path) -> list[str]:
    """mpiexec MPMD: one segment per run of consecutive ranks of the same role, in plan order."""
    mpiexec = find_mpiexec(cfg.launch.mpiexec)
    cmd = [mpiexec]
    if os.path.basename(os.path.realpath(mpiexec)) in ("mpiexec.hydra", "mpiexec", "mpirun"):
        cmd.append("-disable-auto-cleanup")
    cmd += cfg.launch.extra_args
    segments: list[tuple[str, int]] = []
    for p in plan.ranks:
        if segments and segments[-1][0] == p.role:
            segments[-1] = (p.role, segments[-1][1] + 1)
        else:
            segments.append((p.role, 1))
    for i, (role, n) in enumerate(segments):
        if i:
            cmd.append(":")
        cmd += ["-n", str(n), sys.executable, "-m", "rollhpc.rank", str(run_dir), role]
    return cmd


def rank_environment(cfg: ExperimentConfig) -> dict[str, str]:
    env = dict(os.environ)
    # Share the cores: N ranks each starting a full-size OpenMP/torch pool would thrash.
    threads = max(1, (os.cpu_count() or 1) // cfg.world_size())
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env["PYTHONUNBUFFERED"] = "1"
    return env


# MPICH's segments, the controller's one-to-all payloads
SHM_PREFIXES = (
    "mpich_shm_",
    FANOUT_PREFIX,
)


def shm_segments() -> set[str]:
    return (
        {p.name for prefix in SHM_PREFIXES for p in SHM_DIR.glob(prefix + "*")}
        if SHM_DIR.is_dir()
        else set()
    )


def _fnv1a_32(text: str) -> int:
    h = 0x811C9DC5
    for byte in text.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def world_segments(mpiexec: str, mpiexec_pid: int) -> set[str]:
    """The MPICH segment of the world that ``mpiexec`` (pid ``mpiexec_pid``) starts on this machine, where its
    name can be known: gforker calls the job's PMI key-value space ``kvs_<its pid>_0``, and MPICH names a node's
    segment ``mpich_shm_<FNV-1a hash of that name, in hex>_<node index>`` (mpich 5.0). Hydra's name has a random
    part: empty (unknown). Recorded in launch.json, to tell this run's segments from those another MPI job on the
    machine creates or leaves meanwhile (a Slurm job, another run, any process that imported mpi4py: an MPI
    singleton, ``mpich_shm_<its pid in hex>_0``), which a leak check must not blame on this run."""
    if os.path.basename(os.path.realpath(mpiexec)) != "mpiexec.gforker":
        return set()
    return {f"mpich_shm_{_fnv1a_32(f'kvs_{mpiexec_pid}_0'):x}_0"}


def singleton_segment() -> set[str]:
    """This process's own segment, if it is an MPI singleton: the launcher imports mpi4py (MPI_Init) when it
    loads the worker classes; its MPI_Finalize, at exit, removes the segment."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return set()
    return {f"mpich_shm_{os.getpid():x}_0"}


def remove_leaked_segments(
    existing_before: set[str], min_age_s: float = 0.0, ours: set[str] = frozenset()
) -> int:
    """Delete MPICH shared-memory segments that appeared since ``existing_before``, are at least
    ``min_age_s`` old and that no live process maps. MPI_Finalize removes them, but a world that ends by a
    crash or a deliberate abort (every failure path) leaves them in /dev/shm, megabytes each, until reboot.
    ``ours``: the world's own segments (``world_segments``), removed even if one of that name was there before
    it started: MPICH attaches to an existing segment of its name, and pids wrap (pid_max is often 32768), so
    a segment an earlier, killed world with the same mpiexec pid left became this world's."""
    now, present = time.time(), shm_segments()
    leaked = set()
    for name in (present - existing_before) | (present & set(ours)):
        try:
            if now - (SHM_DIR / name).stat().st_mtime >= min_age_s:
                leaked.add(name)
        except OSError:
            pass
    if not leaked:
        return 0
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        if any(prefix in text for prefix in SHM_PREFIXES):
            mapped.update(
                line.rsplit("/", 1)[-1]
                for line in text.splitlines()
                if any("/dev/shm/" + prefix in line for prefix in SHM_PREFIXES)
            )
    removed = 0
    for name in leaked - mapped:
        try:
            (SHM_DIR / name).unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _kill_group(pgid: int, wait_s: float = 5.0, leader: subprocess.Popen | None = None) -> None:
    """SIGKILL whatever is left of the world's process group and wait until it is really gone (its
    memory maps too: the shared-memory sweep must not see dying ranks as users). ``leader``, the group's
    first process and our child, is reaped on the way: a zombie still counts as a member of its group."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if leader is not None:
            leader.poll()
        time.sleep(0.02)


def _children_all_exited(pid: int) -> bool:
    """Whether every child of process ``pid`` has exited (a zombie not yet reaped counts as exited); False
    when that cannot be read."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            stat = Path(f"/proc/{child}/stat").read_text()
            if stat[stat.rindex(")") + 2] not in "ZX":
                return False
    except (OSError, ValueError):
        return False
    return True


def _wait_for_world(
    proc: subprocess.Popen, paths: RunPaths, launched: float, poll_s: float = 0.05
) -> int:
    """Wait until the world has ended: mpiexec has exited, or every rank has exited after the controller
    recorded its exit or after the world formed (this launch's world.json: every rank was started, so none is
    still to come). mpiexec.gforker reaps its ranks one per second (a WNOHANG wait in a loop with a 1 s
    timeout), so it outlives a finished world by about a second per rank: 4-8 s of every local run, test and
    restart spent waiting for nothing, and minutes at a few hundred ranks when gforker itself ended the
    controller before it could record anything (bench/scale.py, 256 ranks: a killed rank's world took ~4 min to
    end). The caller then ends what is left of mpiexec's session."""
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        if (
            paths.controller_exit.exists() or _formed_since(paths.world, launched)
        ) and _children_all_exited(proc.pid):
            # the status that counts is the controller's record (a world without one failed)
            return 0 if paths.controller_exit.exists() else 1


def _formed_since(world_file: Path, launched: float) -> bool:
    """Whether the world of this launch formed (its world.json, not an earlier attempt's, is there)."""
    try:
        return world_file.stat().st_mtime >= launched
    except OSError:
        return False


def _relay_stop_requests(run_dir: Path) -> signal.Handlers | Callable[..., object] | int | None:
    """SIGUSR1 to the launcher: the controller checkpoints after its current step and stops
    (rollhpc.controller.stop). Returns the handler it replaces."""
    return signal.signal(
        signal.SIGUSR1,
        lambda *_: atomic_write_text(
            RunPaths(run_dir).stop_request,
            f"SIGUSR1 to the launcher at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n",
        ),
    )


def _start_world(cfg: ExperimentConfig, cmd: list[str]) -> subprocess.Popen[bytes]:
    """mpiexec in a session of its own, dying with us; the ranks write to our console, not through it."""
    console_env, console_fds = console_for_ranks()
    try:
        return subprocess.Popen(
            cmd,
            env={**rank_environment(cfg), **console_env},
            start_new_session=True,
            preexec_fn=die_with_parent,
            pass_fds=console_fds,
        )
    finally:
        for fd in console_fds:
            os.close(fd)


def _interrupt(proc: subprocess.Popen[bytes]) -> int:
    """Ctrl-C: SIGINT reaches the controller (workers ignore it), which ends the run in order and
    reports it; the launcher's status, 130 if it had none."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rc = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        rc = -signal.SIGKILL
    return rc or 130


def run_local(cfg: ExperimentConfig, plan: WorldPlan, run_dir: Path) -> int:
    """Run the world to completion; returns the controller's exit status (0 = success). mpiexec's own
    status cannot tell: gforker's is 0 whatever its ranks did, so a controller that ended without saying
    how (killed, or a second signal cut its report short) counts as a failure, never as success."""
    paths = RunPaths(run_dir)
    cmd = build_command(cfg, plan, run_dir)
    paths.controller_exit.unlink(missing_ok=True)  # an earlier world's
    # leftovers of earlier worlds that could not clean up (their launcher was SIGKILLed); the age keeps
    # the segments of an MPI job that is starting right now, not yet mapped, out of the sweep
    remove_leaked_segments(set(), min_age_s=120)
    segments_before = shm_segments()
    atomic_write_json(paths.launch, {"command": cmd}, indent=1)
    previous = _relay_stop_requests(run_dir)
    launched = time.time() - 0.05  # (a file's time may lag the clock by a few ms)
    try:
        proc = _start_world(cfg, cmd)
    except BaseException:
        signal.signal(signal.SIGUSR1, previous)
        raise
    ours = world_segments(cmd[0], proc.pid)
    try:
        # which shared memory in /dev/shm is this run's: the world's segment (empty: its name is unknown)
        # and the launcher's own
        launch = {
            "command": cmd,
            "mpiexec_pid": proc.pid,
            "world_shm": sorted(ours),
            "launcher_shm": sorted(singleton_segment()),
        }
        atomic_write_json(paths.launch, launch, indent=1)
        rc = _wait_for_world(proc, paths, launched)
    except KeyboardInterrupt:
        rc = _interrupt(proc)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        _kill_group(proc.pid, leader=proc)
        remove_leaked_segments(segments_before, ours=ours)
    said = controller_exit(run_dir)
    if said is not None:
        return said
    return rc or 1


def failure_summary(run_dir: Path, rc: int) -> str:
    err = RunPaths(run_dir).error
    if err.exists():
        return json.loads(err.read_text())["summary"]
    return (
        f"the MPI world ended (status {rc}) before the controller reported how; "
        f"see the rank logs in {run_dir / 'logs'}"
    )
