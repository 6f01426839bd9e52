"""Slurm launch: a WorldPlan becomes one heterogeneous job whose components are the placement groups,
started as one MPMD ``srun`` so that the controller and every worker share one MPI world.

submitit builds and submits the job and watches it (its Slurm executor has no heterogeneous jobs, so
``HetJobExecutor`` supplies the batch text); inside the job, each task runs ``python -m rollhpc.rank``
directly and finds its role, node and GPUs in RUN_DIR/plan.json.
"""

from __future__ import annotations

import contextlib
import io
import posixpath
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from rollhpc.config import ExperimentConfig
from rollhpc.config.cluster import ClusterConfig
from rollhpc.config.container import ContainerConfig
from rollhpc.launch.resubmit import current_job, rescue_jobs, submit_rescue
from rollhpc.launch.slurm_cli import (
    TERMINAL,
    component_states,
    held_notice,
    held_reason,
    job_records,  # noqa: F401
    restart_count,
    scontrol,
)
from rollhpc.placement.device_mapping import Component, WorldPlan
from rollhpc.rundir import RunPaths, atomic_write_text
from rollhpc.rundir.records import log_event


@dataclass(frozen=True)
class ComponentResources:
    """What one het group asks Slurm for besides its tasks and GPUs."""

    partition: str
    account: str
    qos: str
    mem: str
    exclusive: bool

    def describe(self) -> str:
        """One phrase for `rollhpc plan`: where the group runs and whether it holds its nodes alone."""
        parts = [f"partition {self.partition}" if self.partition else "default partition"]
        parts += [
            f"{k} {v}"
            for k, v in (("account", self.account), ("qos", self.qos), ("mem", self.mem))
            if v
        ]
        return ", ".join(parts) + (
            ", whole nodes (--exclusive)" if self.exclusive else ", nodes shared with other jobs"
        )


def component_resources(cluster: ClusterConfig, comp: Component, het: bool) -> ComponentResources:
    """Group 0 (the controller and the CPU roles) by ``cluster.cpu_component``, the GPU groups by ``cluster.*``.

    The GPU groups of a het job hold their nodes alone (--exclusive): Slurm 22.05's srun cannot start a step
    whose het groups share a node (it waits forever, seen after two node losses), and an exclusive group keeps
    every other group of the job off its nodes. Group 0 then needs no --exclusive of its own: it runs on a CPU
    partition, or on a few CPUs of a node that other jobs share, and never takes a GPU node whole."""
    if comp.index:
        return ComponentResources(
            cluster.partition, cluster.account, cluster.qos, cluster.mem_per_node, het
        )
    return cpu_group_resources(cluster, het)


def cpu_group_resources(cluster: ClusterConfig, het: bool = True) -> ComponentResources:
    """Het group 0's: ``cluster.cpu_component``, its empty values taken from ``cluster.*`` (the rescue job
    runs where it does)."""
    cpu = cluster.cpu_component
    # a GPU node's memory is no measure of a CPU node's: cluster.mem_per_node only for a job with no GPU group
    mem = cpu.mem_per_node or ("" if het else cluster.mem_per_node)
    return ComponentResources(
        cpu.partition or cluster.partition,
        cpu.account or cluster.account,
        cpu.qos or cluster.qos,
        mem,
        cpu.exclusive,
    )


def _component_options(cfg: ExperimentConfig, comp: Component, het: bool) -> list[str]:
    c = cfg.cluster
    res = component_resources(c, comp, het)
    opts = [
        f"--nodes={comp.nodes}",
        f"--ntasks={comp.ntasks}",
        f"--ntasks-per-node={comp.ntasks_per_node}",
        f"--cpus-per-task={comp.cpus_per_task}",
    ]
    if res.exclusive:
        opts.append("--exclusive")
    if comp.gpus_per_node:
        opts.append(f"--gres=gpu:{comp.gpus_per_node}")
    for key, value in (
        ("partition", res.partition),
        ("account", res.account),
        ("qos", res.qos),
        ("mem", res.mem),
    ):
        if value:
            opts.append(f"--{key}={value}")
    return opts + list(c.sbatch_extra)


# the batch script's own limit on forming the world comes this long after the ranks' (their guards say why)
WORLD_TIMEOUT_MARGIN_S = 30.0


# Slurm's pmi2 plugin reads a PMI-1 request (what MPICH's client speaks to it) with one read() of at most
# 1024 bytes, and MPICH cuts a long value into segments of 512 raw bytes, hex-encoded: a segment with few runs of
# zeros makes a line of ~1080 bytes (key and command included), the rest of which the plugin reads as a request
# of its own ("value not properly terminated in client request") and the world never forms. UCX's addresses
# (4-9 KB per node, their content different every run) make such lines now and then; OFI's fit one short line.
# OFI's tcp provider moves a message only while its sender is inside MPI unless auto progress is on, and the
# controller waits on sockets between MPI calls (a worker would wait for its bcast until the controller's next
# MPI call): auto progress on, as UCX behaves. libfabric's own choice of provider here is `sockets`, which
# hung in MPI_Init (every rank spinning in progress) in about 1 of 170 worlds of a 4+1-rank het job on the local
# Slurm; its `tcp` provider formed 400 of 400: tcp, but for MPI_Init alone (FI_PROVIDER exported to the job
# would also hold NCCL's OFI plugin to TCP on EFA or Slingshot). A value set before (the environment sbatch
# passes on, cluster.setup; FI_PROVIDER=verbs where the fabric has it) is kept.
PMI1_SAFE_NETMOD = [
    "# MPICH over srun --mpi=pmi2: the OFI netmod (libfabric's tcp provider, set by each rank while MPI_Init",
    "# runs: NCCL's network plugin keeps the site's provider), whose addresses fit one short PMI line, with auto",
    "# progress",
    "# (rollhpc.launch.slurm says why)",
    *(
        f'export {name}="${{{name}:-{value}}}"'
        for name, value in (
            ("MPIR_CVAR_CH4_NETMOD", "ofi"),
            ("MPIR_CVAR_CH4_OFI_ENABLE_DATA_AUTO_PROGRESS", "1"),
            ("MPIR_CVAR_CH4_OFI_ENABLE_CONTROL_AUTO_PROGRESS", "1"),
            ("ROLLHPC_MPI_FI_PROVIDER", "tcp"),
        )
    ),
]


# srun resolves a task's command on the host, before pyxis enters the container: a bare `python3` the host has
# too would become the host's /usr/bin/python3, which in the image may be another interpreter than the one
# with rollhpc (NVIDIA/pyxis#104). /usr/bin/env is on every host and image and searches the image's PATH.
PYXIS_ENV = "/usr/bin/env"


def container_mounts(container: ContainerConfig, run_dir: Path) -> list[str]:
    """The ranks' bind mounts: ``cluster.container.mounts`` (pyxis's in their long SRC:DST form, which every pyxis
    version reads), then the run directory at its own path unless a writable mount shows it there already.

    The ranks write RUN_DIR (logs, checkpoints, their exit records) and the batch-side helpers read it at the
    host's path, so it must have the same path inside; binding it rather than requiring it spares a run that
    never starts because a mount was forgotten (a mount of it elsewhere does not count)."""
    mounts, shown = [], False
    for mount in container.mounts:
        src, dst, opts = (mount.split(":") + ["", ""])[:3]
        dst = dst or src
        if container.kind == "pyxis" and ":" not in mount:
            mount = f"{src}:{src}"
        mounts.append(mount)
        writable = "ro" not in opts.split("+")
        if (
            writable
            and posixpath.normpath(src) == posixpath.normpath(dst)
            and PurePosixPath(run_dir).is_relative_to(PurePosixPath(posixpath.normpath(src)))
        ):
            shown = True
    if not shown:
        mounts.append(str(run_dir) if container.kind == "apptainer" else f"{run_dir}:{run_dir}")
    return mounts


def _rank_command(container: ContainerConfig, comp: Component, run_dir: Path, python: str) -> str:
    """What srun starts for the ranks of one het group: ``python -m rollhpc.rank RUN_DIR`` on the host, wrapped
    in ``apptainer exec``, or behind pyxis's srun options. Those are the same for every group: pyxis is a SPANK
    plugin, whose options srun holds once per step (a second, different --container-image is refused), so one
    image serves the whole world; apptainer's --nv alone differs, given only where the group has GPUs."""
    run = shlex.quote(str(run_dir))
    if container.kind == "none":
        return f"{python} -m rollhpc.rank {run}"
    mounts = shlex.quote(",".join(container_mounts(container, run_dir)))
    extra = "".join(f" {shlex.quote(opt)}" for opt in container.extra)
    inner = shlex.quote(container.python)
    # --nv: the host's driver libraries and GPU devices, where there are GPUs
    if container.kind == "apptainer":
        return (
            f"apptainer exec{' --nv' if comp.gpus_per_node else ''} --bind {mounts}{extra} "
            f"{shlex.quote(container.image)} {inner} -m rollhpc.rank {run}"
        )
    return (
        f"--container-image={shlex.quote(container.image)} --container-mounts={mounts}{extra} "
        f"{PYXIS_ENV} {inner} -m rollhpc.rank {run}"
    )


def _container_notes(container: ContainerConfig, srun_mpi: str) -> list[str]:
    """Comment lines that say, in a container job's script, what runs where and how MPI is wired."""
    if container.kind == "none":
        return []
    where = {
        "apptainer": [
            "# every rank runs in the Apptainer image (cluster.container; --nv where its het group has",
            "# GPUs); this script, its requeue helpers and the no-op steps run on the host, where",
            "# Slurm's commands are",
        ],
        "pyxis": [
            "# every rank runs in the pyxis (enroot) container (cluster.container): srun keeps the",
            "# --container-* options (SPANK options) once per step, so every het group gets the same",
            "# ones; this script, its requeue helpers and the no-op steps run on the host, where",
            "# Slurm's commands are",
        ],
    }[container.kind]
    wiring = {
        "pmi2": [
            "# MPI inside: the image's MPICH speaks PMI to srun's pmi2 plugin over the PMI_FD socket and",
            "# the PMI_* variables every rank inherits (slurm/README.md, Containers)",
        ],
        "pmix": [
            "# MPI inside: the image's MPI must be built with PMIx; it finds srun's pmix server through",
            "# PMIX_* variables and PMIX_SERVER_TMPDIR, which must be visible inside (slurm/README.md)",
        ],
    }
    return where + wiring.get(srun_mpi, [])


def _uneven(comp: Component) -> bool:
    return comp.ntasks != comp.nodes * comp.ntasks_per_node


def _uneven_hosts_lines(comp: Component, het: bool) -> list[str]:
    """For a group whose last node holds fewer ranks: the host of every rank, in plan order, as srun's
    arbitrary distribution takes them (a plain --ntasks-per-node is ignored there, and block distribution
    rebalances 20/10 into 15/15, putting ranks on GPUs the plan gave others)."""
    if not _uneven(comp):
        return []
    last = comp.ntasks - (comp.nodes - 1) * comp.ntasks_per_node
    nodelist = f"SLURM_JOB_NODELIST_HET_GROUP_{comp.index}" if het else "SLURM_JOB_NODELIST"
    return [
        f"# het group {comp.index}: {comp.ntasks_per_node} ranks on each of its first {comp.nodes - 1} node(s), "
        f"{last} on the last (plan.json): one host per rank",
        f'hosts_{comp.index}=$(scontrol show hostnames "${nodelist}" | awk -v per={comp.ntasks_per_node} '
        f"-v last={last} -v n={comp.nodes} 'NR<n {{for (i = 0; i < per; i++) print}} "
        f"NR==n {{for (i = 0; i < last; i++) print}}' | paste -sd, -)",
    ]


def _srun_segment(cfg: ExperimentConfig, comp: Component, het: bool) -> str:
    """One het group's srun options: its nodes, ranks per node (or one host per rank, for an uneven last node),
    cores per rank bound as ``cluster.cpu_bind`` says, and the node's GPUs in every rank's view (each rank
    picks its own from plan.json, rollhpc.placement.binding): all the group's own values, never group 0's,
    which is what SLURM_CPUS_PER_TASK holds in a het job, and Slurm 22.05-23.02 passes no sbatch
    --cpus-per-task on to srun."""
    opts = [f"--het-group={comp.index}"] if het else []
    opts += [f"--mpi={cfg.cluster.srun_mpi}", f"--nodes={comp.nodes}", f"--ntasks={comp.ntasks}"]
    if _uneven(comp):
        opts += ["--distribution=arbitrary", f'--nodelist="$hosts_{comp.index}"']
    else:
        opts += [f"--ntasks-per-node={comp.ntasks_per_node}", "--distribution=block"]
    opts += [f"--cpus-per-task={comp.cpus_per_task}", f"--cpu-bind={cfg.cluster.cpu_bind}"]
    # every GPU of the node visible to each rank; a site default of --gpu-bind undone
    if comp.gpus_per_node:
        opts += [f"--gres=gpu:{comp.gpus_per_node}", "--gpu-bind=none"]
    return " ".join(opts + [f"--export=ALL,OMP_NUM_THREADS={comp.cpus_per_task}"])


def _directive_lines(cfg: ExperimentConfig, plan: WorldPlan, run_dir: Path) -> list[str]:
    """The script's head: what it runs, then the ``#SBATCH`` block of every component, ``hetjob`` between."""
    c = cfg.cluster
    lines = [
        "#!/bin/bash",
        f"# rollhpc: experiment {cfg.run.name}, {plan.world_size} MPI ranks in {len(plan.components)} het group(s);",
        f"# which rank runs which role on which node/GPU: {run_dir / 'plan.json'} (`rollhpc plan` prints it)",
        f"#SBATCH --job-name=rollhpc-{cfg.run.name}",
        f"#SBATCH --output={run_dir / 'slurm' / 'job-%j.out'}",
        f"#SBATCH --time={c.time_limit}",
    ]
    # never requeued by Slurm (the cluster's JobRequeue default could): a job whose node died ends NODE_FAIL and
    # sets off its rescue job (rollhpc.launch.rescue), where a requeue whose relaunch failed would be held forever
    lines += ["#SBATCH --no-requeue", "#SBATCH --open-mode=append"]
    if c.stop_before_limit_s:  # to the batch shell only (B:): its trap relays it to the controller
        lines.append(f"#SBATCH --signal=B:USR1@{c.stop_before_limit_s}")
    for comp in plan.components:
        if comp.index:
            lines.append("#SBATCH hetjob")
        lines.append(f"# het group {comp.index}: {', '.join(comp.roles)}")
        lines += [
            f"#SBATCH {opt}" for opt in _component_options(cfg, comp, len(plan.components) > 1)
        ]
    return lines


def _setup_lines(cfg: ExperimentConfig, run_dir: Path, helper: str) -> list[str]:
    """Before srun: the time-limit trap, the site's setup, the network, and ``requeue start``."""
    c = cfg.cluster
    lines = [
        "",
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
        "# checkpoint-and-requeue (rollhpc.launch.requeue): at the time-limit warning ask the controller to",
        "# checkpoint and stop (trapped first thing: Slurm may send it up to a minute early); record this",
        "# attempt; after srun, continue the run in a new job if it asked for it or lost a worker",
        f"run_dir={shlex.quote(str(run_dir))}",
        'rm -f "$run_dir/stop-request"  # an earlier attempt\'s request was for that attempt',
        """trap 'echo "time-limit warning (SIGUSR1) at $(date +%FT%T)" > "$run_dir/stop-request"' USR1""",
    ]
    lines += list(c.setup)
    if c.network_interface:
        nic = shlex.quote(c.network_interface)
        lines += [
            "# the interface ranks rendezvous over (cluster.network_interface; rollhpc.transport.rendezvous)",
            f"export ROLLHPC_DIST_IFNAME={nic}",
            *(
                f'export {v}="${{{v}:-{c.network_interface}}}"'
                for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
            ),
        ]
    if c.srun_mpi == "pmi2":
        lines += PMI1_SAFE_NETMOD
    return lines + [
        f'started=$({helper} -m rollhpc.launch.requeue start "$run_dir")',
        '# a finished run stays finished whatever Slurm did; "superseded": a newer job of the run is queued or',
        '# running (this one was requeued by Slurm as well); "requeued": het groups packed onto one node',
        'case "$started" in finished|superseded|requeued) exit 0;; esac',
    ]


def _srun_lines(
    cfg: ExperimentConfig, plan: WorldPlan, run_dir: Path, python: str, helper: str
) -> list[str]:
    """The one MPMD srun of every het group, its watcher beside it, and ``requeue after`` with its status."""
    c = cfg.cluster
    # a single component is a plain job: srun refuses --het-group there
    het = len(plan.components) > 1
    segments = [
        _srun_segment(cfg, comp, het) + " " + _rank_command(c.container, comp, run_dir, python)
        for comp in plan.components
    ]
    # --kill-on-bad-exit=0: a dead worker must not take the controller down before it reports the cause
    first = "--het-group=0 " if het else ""
    return [
        "",
        "set +e",
        "# MPICH names its shared memory after the step (PMI job id), and a requeued job starts again at step",
        "# 0: one no-op step per earlier attempt gives this attempt's world an id of its own, so it never",
        "# opens segments a killed attempt left (MPI_Init: Out of memory); rollhpc.proc.mpi_shm removes those",
        f'for _ in $(seq 1 "${{SLURM_RESTART_COUNT:-0}}"); do '
        f"timeout 60 srun {first}--nodes=1 --ntasks=1 true; done",
        *_container_notes(c.container, c.srun_mpi),
        *[line for comp in plan.components for line in _uneven_hosts_lines(comp, het)],
        "export ROLLHPC_ATTEMPT_STARTED=$(date +%s.%N)",
        "srun --kill-on-bad-exit=0 --unbuffered \\",
        "    " + " \\\n  : ".join(segments) + " &",
        "srun_pid=$!",
        "# once the controller has ended, srun gets end_grace_s; then its step is ended (srun can wait",
        "# forever for a task on a lost node): the decision is the controller's record, not srun's view",
        f'{helper} -m rollhpc.launch.requeue watch "$run_dir" "$srun_pid" --grace {c.end_grace_s:g} '
        f"--world-timeout {cfg.controller.world_timeout_s + WORLD_TIMEOUT_MARGIN_S:g} &",
        "watch_pid=$!",
        "# wait returns early when the trap runs: wait again until srun itself has ended",
        'while :; do wait "$srun_pid"; status=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
        'kill "$watch_pid" 2>/dev/null; wait "$watch_pid" 2>/dev/null',
        f'exec {helper} -m rollhpc.launch.requeue after "$run_dir" "$status" --max-restarts {c.max_restarts}'
        + ("" if c.max_continuations is None else f" --max-continuations {c.max_continuations}")
        + ("" if c.requeue else " --no-requeue"),
        "",
    ]


def render_sbatch(
    cfg: ExperimentConfig, plan: WorldPlan, run_dir: Path, python: str | None = None
) -> str:
    """The batch script: one ``#SBATCH`` block per component, ``hetjob`` between them, then the srun.

    ``python``: the host interpreter of the batch-side helpers (default: this one, which is how the job finds
    rollhpc without a container); with ``cluster.container`` the ranks use the image's, the helpers
    ``cluster.container.batch_python`` when it is set."""
    python = python or shlex.quote(sys.executable)
    container = cfg.cluster.container
    helper = shlex.quote(container.batch_python) if container.batch_python else python
    lines = _directive_lines(cfg, plan, run_dir)
    lines += _setup_lines(cfg, run_dir, helper)
    lines += _srun_lines(cfg, plan, run_dir, python, helper)
    return "\n".join(lines)


def render_rescue(cfg: ExperimentConfig, run_dir: Path, python: str | None = None) -> str:
    """The batch script of the run's rescue jobs (``rollhpc.launch.rescue``): one task, one CPU, minutes. Each is
    submitted with ``--dependency=afterany:JOB`` and JOB as its argument, so it waits holding nothing."""
    c = cfg.cluster
    python = (
        shlex.quote(c.container.batch_python)
        if c.container.batch_python
        else (python or shlex.quote(sys.executable))
    )
    lines = [
        "#!/bin/bash",
        f"# rollhpc: the rescue job of run {cfg.run.name} (rollhpc.launch.rescue). It waits in the queue, holding",
        "# nothing, until the run's job named in $1 has ended (--dependency=afterany), then continues the run from",
        "# its newest good checkpoint if that job's batch script could not (its batch node lost, a failed launch).",
        f"#SBATCH --job-name=rollhpc-rescue-{cfg.run.name}",
        f"#SBATCH --output={run_dir / 'slurm' / 'rescue-%j.out'}",
        "#SBATCH --ntasks=1",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --time=10",
        "#SBATCH --no-requeue",
    ]
    # a CPU job: where the controller's group runs, unless rescue_partition says otherwise
    cpu = cpu_group_resources(c)
    for key, value in (
        ("partition", c.rescue_partition or cpu.partition),
        ("account", cpu.account),
        ("qos", cpu.qos),
    ):
        if value:
            lines.append(f"#SBATCH --{key}={value}")
    lines += [
        "",
        "set -euo pipefail",
        *c.setup,
        f'exec {python} -m rollhpc.launch.rescue {shlex.quote(str(run_dir))} "$1" --max-restarts {c.max_restarts}',
        "",
    ]
    return "\n".join(lines)


class SubmissionRefused(RuntimeError):
    """sbatch refused the job (an unknown account, partition or QOS, a limit): its own reason, one line."""


def _sbatch_reason(text: str) -> str:
    """sbatch's reason from its output: its last error line (``sbatch: error: ...``), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no output"])[-1]


class HetJobExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor with the batch text of a heterogeneous MPMD job."""

    def __init__(self, folder: Path, batch_text: str, world_size: int) -> None:
        super().__init__(folder=folder)
        self._batch_text, self._world_size = batch_text, world_size

    def _make_submission_file_text(self, command: str, uid: str) -> str:  # noqa: ARG002
        return self._batch_text

    def _num_tasks(self) -> int:
        return self._world_size


def submit(cfg: ExperimentConfig, plan: WorldPlan, run_dir: Path) -> submitit.Job[object]:
    """Submit through submitit, then the job's rescue job (``cluster.requeue``); returns submitit's SlurmJob
    (job_id, state, done())."""
    paths = RunPaths(run_dir)
    folder = paths.slurm
    folder.mkdir(parents=True, exist_ok=True)
    # what a restart submits again
    batch_text = render_sbatch(cfg, plan, run_dir)
    atomic_write_text(paths.batch_script, batch_text)
    rescue_script = paths.rescue_script
    if cfg.cluster.requeue:
        atomic_write_text(rescue_script, render_rescue(cfg, run_dir))
    else:
        rescue_script.unlink(missing_ok=True)
    executor = HetJobExecutor(folder, batch_text, plan.world_size)
    said = io.StringIO()  # submitit prints sbatch's errors before raising them: said once, below
    try:
        with contextlib.redirect_stderr(said):
            job = executor._submit_command("rollhpc.rank")  # the command is in the batch text
    except (FailedJobError, FailedSubmissionError) as e:
        raise SubmissionRefused(_sbatch_reason(str(e) or said.getvalue())) from None
    atomic_write_text(paths.job_id, job.job_id + "\n")
    rescue, why = submit_rescue(run_dir, job.job_id)
    if why:
        print(
            f"rollhpc: warning: job {job.job_id} has no rescue job ({why}): should its batch node be lost, "
            f"continue the run with slurm/resume.sh {run_dir}",
            file=sys.stderr,
        )
    return job


def wait_for_job(
    job_id: str,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    *,
    release_held: bool = False,
    run_dir: Path | None = None,
    held_grace_s: float = 30.0,
) -> str:
    """Block until the run's job has ended for good; COMPLETED if all its components completed, else the first
    other state. With ``run_dir``, a job that continued the run in a new one (RUN_DIR/slurm/job_id, written
    by ``rollhpc.launch.resubmit``) is followed to that one, and so on.

    A job Slurm holds (its launch failed: "launch failed requeued held") would never end by itself, so each
    poll also reads its pending reason: once held for ``held_grace_s`` in one attempt (the batch script's own
    requeuehold -> update -> release passes within a second), a line says how to release it, and with
    ``release_held`` (cluster.release_held) it is released, once per attempt, logged in RUN_DIR/restarts.jsonl.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    holds = HoldWatch(job_id, release_held, run_dir, held_grace_s)
    while True:
        states = component_states(job_id)
        if states and all(st in TERMINAL for st in states.values()):
            successor = current_job(run_dir) if run_dir is not None else None
            if successor and successor != job_id:
                print(
                    f"rollhpc: job {job_id} ended; job {successor} continues the run",
                    file=sys.stderr,
                    flush=True,
                )
                job_id, holds = successor, HoldWatch(successor, release_held, run_dir, held_grace_s)
                continue
            rescue = rescue_jobs(run_dir).get(job_id) if run_dir is not None else None
            if rescue and any(st not in TERMINAL for st in component_states(rescue).values()):
                # its rescue job decides whether the run goes on (rollhpc.launch.rescue)
                time.sleep(poll_s)
                continue
            bad = [st for st in states.values() if st != "COMPLETED"]
            return bad[0] if bad else "COMPLETED"
        holds.poll()
        if deadline is not None and time.monotonic() > deadline:
            return "WAIT_TIMEOUT"
        time.sleep(poll_s)


class HoldWatch:
    """``wait_for_job``'s eye on holds: says once per attempt (scontrol's Restarts, sacct's RestartCnt) that
    the job is held and, when asked to, releases it then (``scontrol release``)."""

    def __init__(self, job_id: str, release: bool, run_dir: Path | None, grace_s: float):
        self.job_id, self.release, self.run_dir, self.grace_s = job_id, release, run_dir, grace_s
        # (attempt, monotonic time) of the first held poll
        self._held_since: tuple[int, float] | None = None
        self._handled: set[int] = set()  # attempts already reported (and released)

    def poll(self) -> None:
        records, _ = job_records(self.job_id)
        held = [why for r in records or [] if (why := held_reason(r))]
        if not held:
            self._held_since = None
            return
        attempt, now = restart_count(records or []), time.monotonic()
        if self._held_since is None or self._held_since[0] != attempt:
            self._held_since = (attempt, now)
        if now - self._held_since[1] < self.grace_s or attempt in self._handled:
            return
        self._handled.add(attempt)
        print(f"rollhpc: {held_notice(self.job_id, held[0])}", file=sys.stderr, flush=True)
        if self.release:
            self._release(attempt, held[0])

    def _release(self, attempt: int, reason: str) -> None:
        res = scontrol("release", self.job_id)
        outcome = (
            "released it" if res.returncode == 0 else f"could not release it: {res.stderr.strip()}"
        )
        print(
            f"rollhpc: job {self.job_id}: {outcome} (cluster.release_held=true)",
            file=sys.stderr,
            flush=True,
        )
        if self.run_dir is not None:
            log_event(
                self.run_dir,
                {
                    "event": "release",
                    "job_id": self.job_id,
                    "slurm_restart_count": attempt,
                    "reason": f"held by Slurm ({reason}): {outcome} (cluster.release_held)",
                    "ok": res.returncode == 0,
                },
            )
