"""Typed experiment configuration, validated when it is loaded.

Hydra composes YAML and applies overrides at the CLI boundary; what reaches the library is a plain
dict, turned here into dataclasses. Every mistake is reported before any process starts, naming
the dotted key: unknown keys list the valid ones, wrong types say what was expected.
Components (the pipeline, each role's worker) are named by import path and carry an ``options``
mapping that is validated against the component's own ``Options`` dataclass.

Longer than our ~600-line rule on purpose: every section of an experiment's YAML is declared here, next to the
generic loader that checks them, so a key's name, type, default and check are found in one file.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollhpc.parallel import ParallelLayout

CONTROLLER_ROLE = "controller"


class ConfigError(ValueError):
    """A configuration mistake, with the dotted path of the offending key."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Megatron 5D layout of a role's ranks (dp is what remains: procs / (tp * cp * pp))."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; None: same as tp
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule)
    order: str = "tp-cp-ep-dp-pp"  # megatron's rank order, fastest-varying first


@dataclass(kw_only=True)
class RoleConfig:
    worker: str  # "package.module:Class", a subclass of rollhpc.protocol.worker.Worker
    procs: int = 1  # MPI ranks of this role
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    gpus_per_proc: int = 0  # GPUs each rank drives (0: a CPU role; a vLLM engine with TP 4: 4)
    cpus_per_proc: int = 1
    # Explicit global GPU ids (node * gpus_per_node + local id), procs * gpus_per_proc of them. Roles
    # given the same list share those GPUs (colocated); roles without a list get GPUs of their own.
    devices: list[int] | None = None
    # a mapping; after load, the worker's Options instance
    options: Any = field(default_factory=dict)
    # Environment variables of this role's ranks, set when a rank learns its role, before the role's modules
    # load (torch and its OpenMP runtime read theirs at load): e.g. OMP_WAIT_POLICY=PASSIVE where roles share
    # cores at the same time (async generation), VLLM_* for a generator, NCCL_* for a trainer
    env_vars: dict[str, Any] = field(default_factory=dict)  # values: strings or numbers

    def layout(self) -> ParallelLayout:
        p = self.parallel
        return ParallelLayout(
            world=self.procs,
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            etp=p.etp,
            vpp=p.vpp,
            order=p.order,
        )


@dataclass(kw_only=True)
class PipelineConfig:
    entry: str  # "package.module:Class", a subclass of rollhpc.protocol.pipeline.Pipeline
    # a mapping; after load, the pipeline's Options instance
    options: Any = field(default_factory=dict)


@dataclass(kw_only=True)
class ControllerConfig:
    call_timeout_s: float = 900.0  # default limit on every wait for workers; per call overridable
    # forming the world: each rank's MPI_Init, the first collectives, every worker's connection to the
    # controller. Seconds when healthy; when it hangs the process manager is broken, and a requeue helps.
    world_timeout_s: float = 180.0
    # constructing the workers once the world is up: loading models and engines, minutes for large ones
    startup_timeout_s: float = 1200.0
    stack_dump_timeout_s: float = 10.0  # how long to wait for stacks after a timeout
    shutdown_timeout_s: float = 30.0
    # an MPI call on the controller that has not returned after this long is stuck on a peer that is gone
    # (rollhpc.controller.mpi_stall): the run is ended and reported, naming a dead worker when there is one
    mpi_stall_s: float = 30.0
    # a worker's communication error (gloo/NCCL/MPI, a collective's timeout) is usually the echo of a peer's
    # death that the controller has not seen yet: it looks this long for a dead worker (sideband, Slurm's node
    # states) before it decides between a lost worker and a lost peer (rollhpc.controller.failure). A dead
    # node's connections can take TCP keepalive's ~11 s to drop
    peer_loss_settle_s: float = 15.0
    # how a one-to-all call's payload of 1 MiB or more reaches a role's ranks: "broadcast" (MPI broadcasts
    # over the controller and the role: the network carries each byte once per tree edge), "p2p" (one send
    # per rank), "auto": broadcast to roles with ranks on other machines than the controller's; to a role
    # on its machine, one file in /dev/shm that every rank maps copy-on-write (one copy in all, not N; ranks in
    # containers with a /dev/shm of their own need p2p)
    one_to_all: typing.Literal["auto", "broadcast", "p2p"] = "auto"
    # a call to this many ranks or more has their replies collected along a tree (rollhpc.transport.reply_tree):
    # each node's leader gathers its node's, leaders gather each other's in groups of reply_fan_in, and the
    # controller takes at most reply_fan_in messages per call instead of one per rank. Below ~100 ranks rank 0's
    # replies cost it well under a millisecond a call and a tree's extra hops do not pay (bench/reply_path.py);
    # 0: never, every rank replies to the controller itself
    reply_tree_min_ranks: int = 128
    reply_fan_in: int = 16

    def __post_init__(self) -> None:
        if self.reply_tree_min_ranks < 0:
            raise ConfigError(
                f"controller.reply_tree_min_ranks: 0 (no reply trees) or more, not "
                f"{self.reply_tree_min_ranks}"
            )
        if self.reply_fan_in < 2:
            raise ConfigError(
                f"controller.reply_fan_in: 2 or more (the most bundles a rank of a reply tree collects "
                f"per level, and the controller per call), not {self.reply_fan_in}"
            )


@dataclass(kw_only=True)
class RunConfig:
    name: str
    output_dir: str = "runs"
    seed: int = 0

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


@dataclass(kw_only=True)
class ContainerConfig:
    """The image every MPI rank of a Slurm job runs in (``cluster.container``; slurm/README.md, "Containers").

    rollhpc.launch.slurm wraps each rank's command: ``apptainer exec [--nv] --bind ... IMAGE python3 -m
    rollhpc.rank`` or pyxis's ``srun --container-image=IMAGE --container-mounts=...``. The batch script and its
    requeue helpers stay on the host: they run scontrol, sbatch and squeue, which an image does not have. Every
    value is checked here, at load, because a wrong one would otherwise show only as a job that fails on its nodes.
    """

    kind: typing.Literal["none", "apptainer", "pyxis"] = "none"  # none: the ranks run on the host
    # apptainer: an absolute path to a .sif (or a sandbox directory) that every node sees; pyxis: an enroot
    # image, "[USER@][REGISTRY#]IMAGE[:TAG]" (quote a '#' in an override) or an absolute path to a .sqsh
    image: str = ""
    # bind mounts "src[:dst[:opts]]", absolute paths (dst defaults to src); opts: apptainer's ro|rw, pyxis's
    # mount flags joined with "+" (ro+rprivate). The run directory is added at its own path unless a writable
    # mount shows it there already (the ranks and the batch-side helpers must name it alike).
    mounts: list[str] = field(default_factory=list)
    # more options, one per item ("--flag" or "--flag=value"): apptainer exec's (--writable-tmpfs), or pyxis's
    # srun options (--container-workdir=/work, --no-container-mount-home, --container-writable)
    extra: list[str] = field(default_factory=list)
    python: str = "python3"  # the image's interpreter for `-m rollhpc.rank`: a name on the image's PATH or a path
    # the host interpreter for the batch-side `-m rollhpc.launch.requeue` helpers (stdlib and pyyaml suffice);
    # "": the one that ran `rollhpc submit`, as without a container: it must then be visible on the batch node
    batch_python: str = ""

    KINDS = ("none", "apptainer", "pyxis")
    # apptainer exec options that start the container with a cleared environment: srun's PMI_* variables (the
    # MPI wiring) and SLURM_*/CUDA_VISIBLE_DEVICES would not reach the ranks
    CLEARS_ENV = ("-e", "--cleanenv", "-C", "--containall", "--compat")
    PYXIS_FLAGS = re.compile(r"[A-Za-z0-9_=.-]+(\+[A-Za-z0-9_=.-]+)*")

    def __post_init__(self) -> None:
        w = "cluster.container"
        if self.kind not in self.KINDS:
            raise ConfigError(f"{w}.kind: {self.kind!r} is not one of {list(self.KINDS)}")
        if self.kind == "none":
            given = [
                f.name
                for f in dataclasses.fields(self)
                if f.name != "kind"
                and getattr(self, f.name)
                != (f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
            ]
            if given:
                raise ConfigError(
                    f"{w}.{given[0]}: set, but {w}.kind is 'none' (the ranks run on the host): set "
                    f"{w}.kind=apptainer or {w}.kind=pyxis, or drop it"
                )
            return
        self._check_image(w)
        for i, mount in enumerate(self.mounts):
            self._check_mount(mount, f"{w}.mounts[{i}]")
        for i, opt in enumerate(self.extra):
            self._check_option(opt, f"{w}.extra[{i}]")
        for name in ("python", "batch_python"):
            value = getattr(self, name)
            if value and (
                value != value.strip()
                or len(value.split()) != 1
                or ("/" in value and value[0] != "/")
            ):
                raise ConfigError(
                    f"{w}.{name}: {value!r} is not one interpreter: give a name found on the PATH or "
                    "an absolute path (a relative one depends on the job's working directory)"
                )
        if not self.python:
            raise ConfigError(
                f"{w}.python: empty: name the image's interpreter (python3, /opt/venv/bin/python)"
            )

    def _check_image(self, w: str) -> None:
        image = self.image
        if not image.strip():
            what = "a .sif path" if self.kind == "apptainer" else "an enroot image or a .sqsh path"
            raise ConfigError(
                f"{w}.image: empty: kind {self.kind} needs the image every rank runs in ({what})"
            )
        if image != image.strip() or len(image.split()) != 1:
            raise ConfigError(f"{w}.image: {image!r} contains whitespace")
        if self.kind == "apptainer":
            if "://" in image:  # every rank would pull and convert it at once, on every start
                raise ConfigError(
                    f"{w}.image: {image!r}: every rank would pull and convert it as it starts; "
                    f"build it once (apptainer build /shared/images/NAME.sif {image}) and name the .sif"
                )
            if not image.startswith("/"):
                raise ConfigError(
                    f"{w}.image: {image!r} is relative: give an absolute path on a filesystem every "
                    "node mounts (a resumed run may start in another working directory)"
                )
        elif image.endswith(".sif"):
            raise ConfigError(
                f"{w}.image: {image!r} is an Apptainer image: enroot (pyxis) imports a registry image "
                f"or a squashfs file (.sqsh); or set {w}.kind=apptainer"
            )
        elif image.endswith((".sqsh", ".squashfs")) and not image.startswith("/"):
            raise ConfigError(
                f"{w}.image: {image!r}: pyxis reads a name that does not start with / (or ./) as a "
                "registry image: give the squashfs file's absolute path"
            )

    def _check_mount(self, mount: str, where: str) -> None:
        form = "'src[:dst[:opts]]' with absolute paths, one mount per item"
        parts = mount.split(":")
        if "," in mount or len(parts) > 3 or "" in parts or any(p != p.strip() for p in parts):
            raise ConfigError(f"{where}: {mount!r} is not {form}")
        if not all(p.startswith("/") for p in parts[:2]):
            raise ConfigError(
                f"{where}: {mount!r}: source and destination must be absolute paths ({form})"
            )
        if len(parts) == 3:
            opts = parts[2]
            if self.kind == "apptainer" and opts not in ("ro", "rw"):
                raise ConfigError(
                    f"{where}: {mount!r}: apptainer's bind options are ro or rw, got {opts!r}"
                )
            if self.kind == "pyxis" and not self.PYXIS_FLAGS.fullmatch(opts):
                raise ConfigError(
                    f"{where}: {mount!r}: pyxis's mount flags are joined with '+' (ro+rprivate), "
                    f"got {opts!r}"
                )

    def _check_option(self, opt: str, where: str) -> None:
        if not opt.startswith("-") or len(opt.split()) != 1 or opt != opt.strip():
            raise ConfigError(
                f"{where}: {opt!r}: one option per item, written --flag or --flag=value"
            )
        name = opt.partition("=")[0]
        if self.kind == "apptainer" and name in self.CLEARS_ENV:
            raise ConfigError(
                f"{where}: {opt!r} clears the environment inside the container: srun's PMI_* "
                "variables would not reach MPI (each rank would form a world of its own), nor "
                "SLURM_* and CUDA_VISIBLE_DEVICES the rank's GPU binding"
            )
        if self.kind == "pyxis":
            if not name.startswith(("--container-", "--no-container-")):
                raise ConfigError(
                    f"{where}: {opt!r}: pyxis's options are srun's --container-* and "
                    "--no-container-* (an apptainer flag?)"
                )
            if name in ("--container-image", "--container-mounts"):
                raise ConfigError(
                    f"{where}: {opt!r}: set it with cluster.container.{name.rsplit('-', 1)[1]}"
                )


@dataclass(kw_only=True)
class CpuComponentConfig:
    """Het group 0 of a Slurm job: the controller and every CPU role (reward, env, judges without GPUs).

    It needs no GPU node: on a cluster with a CPU partition it goes there (its own account, QOS, memory and node
    size), shares its nodes with other jobs unless ``exclusive``, and leaves every GPU to the GPU groups. Empty
    values fall back to ``cluster.*``; ``mem_per_node`` falls back only while it shares the GPU groups' partition
    (a CPU node is rarely the size of a GPU node). The GPU groups are always --exclusive, so that the job's own
    groups never pack onto one node (Slurm 22.05's srun cannot start such a step; rollhpc.launch.slurm)."""

    partition: str = ""  # e.g. cpu; empty: cluster.partition
    account: str = ""  # empty: cluster.account
    qos: str = ""  # empty: cluster.qos
    mem_per_node: str = ""  # sbatch --mem of its nodes, e.g. 64G
    cpus_per_node: int = (
        0  # CPUs of one of its nodes (how many ranks share one); 0: cluster.cpus_per_node
    )
    nodes: int = 0  # at most this many nodes; 0: cluster.nodes
    exclusive: bool = False  # whole nodes of its own (--exclusive)

    def __post_init__(self) -> None:
        _check_slurm_names(self, "cluster.cpu_component")
        if self.cpus_per_node < 0 or self.nodes < 0:
            raise ConfigError(
                f"cluster.cpu_component.cpus_per_node and .nodes must be >= 0 (0: the cluster's), "
                f"got {self.cpus_per_node}, {self.nodes}"
            )


CPU_BIND_CHOICES = ("cores", "threads", "sockets", "ldoms", "none")


@dataclass(kw_only=True)
class ClusterConfig:
    """The Slurm cluster a plan targets (``rollhpc plan`` and ``rollhpc submit``)."""

    nodes: int = 1  # nodes the job may use at most
    gpus_per_node: int = 0
    cpus_per_node: int = 8
    # memory of one GPU in GB (e.g. 80 for an H100): `rollhpc plan` then checks every GPU's peak memory stage
    # by stage, and a colocated mapping that cannot fit even with offload is refused before submission
    gpu_memory_gb: float = 0.0
    partition: str = ""
    account: str = ""
    qos: str = ""
    # sbatch --time, in one of SLURM_TIME_FORMS, as a string: quote it in a YAML file (unquoted, YAML reads
    # 4:00:00 as the base-60 number 14400), so a number is refused rather than guessed at
    time_limit: str | int = "01:00:00"
    mem_per_node: str = ""  # e.g. "256G"; empty: the partition's default
    srun_mpi: str = "pmi2"  # srun --mpi=... (pmi2 for MPICH, pmix for Open MPI)
    # srun --cpu-bind for every rank: each rank (and the threads and processes it starts) on its own
    # cpus_per_proc cores; "none" leaves placement to the kernel (a node's ranks may then share cores)
    cpu_bind: str = "cores"
    # the network interface ranks rendezvous over (torch.distributed's store, the weight channel, the controller's
    # sideband), e.g. "ib0" or "hsn0": exported as ROLLHPC_DIST_IFNAME and, unless already set, as
    # GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; each rank takes its own node's address of it. Empty: host names
    network_interface: str = ""
    # more "--key=value" options for every component
    sbatch_extra: list[str] = field(default_factory=list)
    # shell lines run in the batch script before srun
    setup: list[str] = field(default_factory=list)
    # the image the ranks run in (apptainer or pyxis); kind none: on the host, with the submitting interpreter
    container: ContainerConfig = field(default_factory=ContainerConfig)
    # where the controller and the CPU roles run (het group 0): a CPU partition of their own, not a GPU node
    cpu_component: CpuComponentConfig = field(default_factory=CpuComponentConfig)
    # the run continues by itself after a lost node, worker or peer, a time limit or a failed launch: the batch
    # script submits the next job, and a rescue job waiting on each job (--dependency=afterany) does when the
    # batch script could not (its node lost); each resumes from the newest good checkpoint. false: the run ends
    requeue: bool = True
    max_restarts: int = (
        5  # restarts after failures (lost workers, peers, batch nodes) before the run gives up
    )
    # the partition of the rescue jobs (one CPU for seconds, only after a job ended); empty: the CPU component's
    rescue_partition: str = ""
    stop_before_limit_s: int = (
        300  # time-limit warning: checkpoint and requeue this long before the end (0: off)
    )
    # a held job (a person's or the site's hold: the run's own jobs are --no-requeue, so Slurm never leaves them
    # "launch failed requeued held"): `rollhpc submit --wait` releases it, once per attempt, when true;
    # otherwise it says which command releases it
    release_held: bool = False
    # once the controller has ended, how long srun may take to end by itself before the batch script ends
    # the step: srun can wait forever for a task on a lost node that came back under a new slurmd. The
    # workers' part is done by then (they acknowledged the shutdown, or were released after a failure)
    end_grace_s: float = 1.0

    def __post_init__(self) -> None:
        if (
            self.max_restarts < 0
            or self.stop_before_limit_s < 0
            or self.end_grace_s < 0
            or self.gpu_memory_gb < 0
        ):
            raise ValueError(
                "cluster.max_restarts, cluster.stop_before_limit_s, cluster.end_grace_s and "
                "cluster.gpu_memory_gb must be >= 0"
            )
        # YAML reads an unquoted 4:00:00 as 14400: never guess what was meant
        if isinstance(self.time_limit, int):
            raise ConfigError(
                f"cluster.time_limit: got the number {self.time_limit}, which YAML also makes of an unquoted "
                f"H:MM:SS ({self.time_limit // 3600}:{self.time_limit % 3600 // 60:02d}:{self.time_limit % 60:02d} "
                f"gives {self.time_limit}): quote it in a YAML file ('4:00:00', '90'), or write it with a colon on "
                "the command line (cluster.time_limit=90:00 for 90 minutes)"
            )
        _check_slurm_names(self, "cluster")
        if self.network_interface and not re.fullmatch(r"[\w.:-]+", self.network_interface):
            raise ConfigError(
                f"cluster.network_interface: {self.network_interface!r} is not an interface name "
                "(e.g. ib0, hsn0, eth1)"
            )
        if self.cpu_bind not in CPU_BIND_CHOICES:
            raise ConfigError(
                f"cluster.cpu_bind: {self.cpu_bind!r} is not one of {', '.join(CPU_BIND_CHOICES)} "
                "(srun --cpu-bind)"
            )
        if self.nodes < 1 or self.cpus_per_node < 1 or self.gpus_per_node < 0:
            raise ConfigError(
                f"cluster.nodes and cluster.cpus_per_node must be >= 1 and cluster.gpus_per_node >= 0, "
                f"got {self.nodes}, {self.cpus_per_node}, {self.gpus_per_node}"
            )
        try:  # sbatch would refuse it only once the job is submitted; a typo must not get that far
            limit_s = parse_slurm_time(self.time_limit)
        except ValueError as e:
            raise ConfigError(f"cluster.time_limit: {e}") from None
        if limit_s is not None and 0 < limit_s <= self.stop_before_limit_s:
            raise ConfigError(
                f"cluster.stop_before_limit_s: {self.stop_before_limit_s} s is not shorter than cluster.time_limit="
                f"{self.time_limit} ({limit_s} s): the time-limit warning would come at once; lower it (0: off) or "
                "raise the time limit"
            )


_SLURM_NAME = r"[A-Za-z0-9_.\-]+"
_SLURM_NAMES = (  # (key, what Slurm takes, how to say it)
    (
        "partition",
        rf"{_SLURM_NAME}(,{_SLURM_NAME})*",
        "a Slurm partition name (or a comma-separated list), e.g. gpu",
    ),
    ("rescue_partition", rf"{_SLURM_NAME}(,{_SLURM_NAME})*", "a Slurm partition name, e.g. cpu"),
    ("account", _SLURM_NAME, "a Slurm account name, e.g. proj123"),
    ("qos", _SLURM_NAME, "a Slurm QOS name, e.g. normal"),
    (
        "mem_per_node",
        r"[0-9]+[KMGTkmgt]?",
        "a Slurm memory size (sbatch --mem): a number of MB or with a unit, "
        "e.g. 256G, 512000M; 0 is all of the node's memory",
    ),
)


def _check_slurm_names(section: Any, where: str) -> None:
    """The ``_SLURM_NAMES`` fields ``section`` has, in Slurm's syntax: they are copied into #SBATCH lines as they
    are, where a space or ';' breaks them."""
    for key, pattern, form in _SLURM_NAMES:
        if not hasattr(section, key):
            continue
        value = getattr(section, key)
        if not isinstance(value, str) or (value and not re.fullmatch(pattern, value)):
            raise ConfigError(f"{where}.{key}: {value!r} is not {form}")


SLURM_TIME_FORMS = (
    "minutes",
    "minutes:seconds",
    "hours:minutes:seconds",
    "days-hours",
    "days-hours:minutes",
    "days-hours:minutes:seconds",
    "UNLIMITED",
)
_SLURM_TIME = re.compile(
    r"(?:(?P<days>[0-9]+)-)?(?P<a>[0-9]+)(?::(?P<b>[0-9]+))?(?::(?P<c>[0-9]+))?"
)


def parse_slurm_time(text: str) -> int | None:
    """Seconds in a Slurm time limit (sbatch --time), None for UNLIMITED or INFINITE (any case).

    Accepts exactly Slurm's forms (``SLURM_TIME_FORMS``); fields may exceed their unit (90:00 is 90 minutes),
    as Slurm normalizes them. Refuses anything else, and a zero limit: Slurm reads 0 as "no limit", which is
    written UNLIMITED here so that a slip (0:00, 0-0) does not ask for a job without end.
    """
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    forms = f"accepted forms: {', '.join(SLURM_TIME_FORMS)} (e.g. 90, 4:00:00, 2-12:00:00)"
    m = _SLURM_TIME.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a Slurm time limit; {forms}")
    days, a, b, c = (int(x) if x is not None else None for x in m.group("days", "a", "b", "c"))
    if days is not None:  # days-hours[:minutes[:seconds]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # hours:minutes:seconds
        seconds = a * 3600 + b * 60 + c
    else:  # minutes[:seconds]
        seconds = a * 60 + (b or 0)
    if seconds == 0:
        raise ValueError(
            f"{text!r} is zero, which Slurm reads as no limit at all: write UNLIMITED for that; {forms}"
        )
    return seconds


@dataclass(kw_only=True)
class LaunchConfig:
    mpiexec: str = "auto"  # "auto": the venv's mpiexec (mpich wheel), else the one on PATH
    extra_args: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class ExperimentConfig:
    run: RunConfig
    pipeline: PipelineConfig
    roles: dict[str, RoleConfig]
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def world_size(self) -> int:
        return 1 + sum(r.procs for r in self.roles.values())


def _split_import_path(path: str, where: str) -> tuple[str, str]:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError(
            f"{where}: {path!r} is not an import path of the form 'package.module:Name'"
        )
    return module, name


def import_object(path: str, where: str) -> Any:
    module, name = _split_import_path(path, where)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import {path!r}: {e}") from e


def import_spec(path: str, where: str) -> Any:
    """The plan-time side of the worker or pipeline ``path`` names (rollhpc.protocol.spec): its spec class, found
    without importing the runtime module, or the runtime class itself when it has no spec. What config loading,
    ``plan`` and ``submit --dry-run`` read, so that they import no torch, megatron or vllm."""
    from rollhpc.protocol.spec import find_spec

    module, name = _split_import_path(path, where)
    try:
        spec = find_spec(module, name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import the spec of {path!r}: {e}") from e
    return spec if spec is not None else import_object(path, where)


def _type_name(tp: Any) -> str:
    """A type as an error message shows it: a union as its alternatives (typing's own name for one is "Union")."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(alt) for alt in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return (
                None  # before the dataclass alternatives, which would read None as "all defaults"
            )
        errors = []
        for alt in typing.get_args(tp):
            if alt is type(None):
                if value is None:
                    return None
                continue
            try:
                return _convert(value, alt, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} does not match {_type_name(tp)}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, vt = typing.get_args(tp)
        return {str(k): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (et, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(v, et, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(
                f"{where}: expected {tp.__name__}, got {value!r} ({type(value).__name__})"
            )
        return value
    raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass ``cls`` from ``data``, recursively, rejecting unknown and missing keys."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}"
            + (f" (and {unknown[1:]})" if unknown[1:] else "")
            + f"; valid keys: {', '.join(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from e


def component_options(component: Any, options: dict[str, Any], where: str) -> Any:
    """Validate a component's options against its ``Options`` dataclass (a dict if it has none)."""
    opts_cls = getattr(component, "Options", None)
    if not isinstance(options, dict) and not (opts_cls and isinstance(options, opts_cls)):
        raise ConfigError(f"{where}: expected a mapping, got {options!r}")
    if opts_cls is None:
        if options:
            name = component.__name__.removesuffix("Spec")  # a spec speaks for its runtime class
            raise ConfigError(f"{where}: {name} takes no options, got {sorted(options)}")
        return {}
    return from_dict(opts_cls, options, where)


def validate(cfg: ExperimentConfig) -> None:
    """Cross-field checks and component resolution: everything that can fail before launch."""
    if not cfg.roles:
        raise ConfigError("roles: an experiment needs at least one worker role")
    if CONTROLLER_ROLE in cfg.roles:
        raise ConfigError(f"roles.{CONTROLLER_ROLE}: the name is reserved for rank 0")
    from rollhpc.protocol.spec import PipelineSpec, WorkerSpec

    for name, role in cfg.roles.items():
        where = f"roles.{name}"
        if not name.isidentifier():
            raise ConfigError(f"{where}: role names must be identifiers")
        if role.procs < 1:
            raise ConfigError(f"{where}.procs: must be >= 1, got {role.procs}")
        if role.cpus_per_proc < 1 or role.gpus_per_proc < 0:
            raise ConfigError(
                f"{where}: cpus_per_proc must be >= 1 and gpus_per_proc >= 0, got {role.cpus_per_proc} "
                f"and {role.gpus_per_proc}"
            )
        for key, value in role.env_vars.items():
            if not (
                isinstance(key, str) and key.replace("_", "a").isalnum() and not key[0].isdigit()
            ):
                raise ConfigError(f"{where}.env_vars: {key!r} is not an environment variable name")
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ConfigError(
                    f"{where}.env_vars.{key}: give a string (or number), got {value!r}"
                )
        role.env_vars = {k: str(v) for k, v in role.env_vars.items()}
        try:
            role.layout()
        except ValueError as e:
            raise ConfigError(f"{where}.parallel: {e}") from e
        cls = import_spec(role.worker, f"{where}.worker")
        if not (isinstance(cls, type) and issubclass(cls, WorkerSpec)):
            raise ConfigError(f"{where}.worker: {role.worker} is not a rollhpc Worker subclass")
        try:
            cls.check_layout(role.layout())
        except ValueError as e:
            raise ConfigError(f"{where}.parallel: {e}") from e
        role.options = component_options(cls, role.options, f"{where}.options")
        try:
            cls.check_model(role.layout(), role.options)
        except ValueError as e:
            raise ConfigError(f"{where}.parallel: {e}") from e
        engine_tp = getattr(role.options, "tensor_parallel_size", None)
        if (
            role.gpus_per_proc > 0
            and isinstance(engine_tp, int)
            and engine_tp != role.gpus_per_proc
        ):
            raise ConfigError(
                f"{where}.options.tensor_parallel_size={engine_tp} but {where}.gpus_per_proc="
                f"{role.gpus_per_proc}: each rank's engine spreads over the GPUs its rank gets (the "
                "memory plan counts them so); set both the same"
            )
    pipeline = import_spec(cfg.pipeline.entry, "pipeline.entry")
    if not (isinstance(pipeline, type) and issubclass(pipeline, PipelineSpec)):
        raise ConfigError(
            f"pipeline.entry: {cfg.pipeline.entry} is not a rollhpc Pipeline subclass"
        )
    cfg.pipeline.options = component_options(pipeline, cfg.pipeline.options, "pipeline.options")
    try:
        pipeline.check_roles(cfg.pipeline.options, cfg.roles)
    except ValueError as e:
        raise ConfigError(f"pipeline.options: {e}") from e
    for role in pipeline.required_roles:
        if role not in cfg.roles:
            name = pipeline.__name__.removesuffix("Spec")
            raise ConfigError(
                f"roles: pipeline {name} needs a {role!r} role; configured: {sorted(cfg.roles)}"
            )
    _check_token_budget(cfg)
    for name in (
        "call_timeout_s",
        "world_timeout_s",
        "startup_timeout_s",
        "stack_dump_timeout_s",
        "shutdown_timeout_s",
        "mpi_stall_s",
    ):
        if getattr(cfg.controller, name) <= 0:
            raise ConfigError(
                f"controller.{name}: must be positive, got {getattr(cfg.controller, name)}"
            )
    if cfg.controller.peer_loss_settle_s < 0:
        raise ConfigError(
            f"controller.peer_loss_settle_s: must be >= 0, got {cfg.controller.peer_loss_settle_s}"
        )


def generator_max_model_len(roles: dict[str, Any] | None) -> int | None:
    """The generator's context length (prompt + response), when the run has a ``generate`` role whose worker
    has one (``roles.generate.options.max_model_len``)."""
    gen = (roles or {}).get("generate")
    value = getattr(getattr(gen, "options", None), "max_model_len", None)
    return value if isinstance(value, int) else None


def _check_token_budget(cfg: ExperimentConfig) -> None:
    """The generator's context holds the prompt and the response: a response budget that alone fills
    ``max_model_len`` fails only at the first request, once the world is up."""
    max_len = generator_max_model_len(cfg.roles)
    rollout = getattr(cfg.pipeline.options, "rollout", None)
    if not isinstance(max_len, int) or rollout is None:
        return
    for key, value in (
        ("rollout.max_tokens", getattr(rollout, "max_tokens", None)),
        ("eval_max_tokens", getattr(cfg.pipeline.options, "eval_max_tokens", None)),
    ):
        if isinstance(value, int) and value >= max_len:
            raise ConfigError(
                f"pipeline.options.{key}={value} does not fit roles.generate.options.max_model_len="
                f"{max_len}, which holds the prompt and the response: raise max_model_len or lower "
                f"{key}"
            )


def _check_role_names(data: dict[str, Any]) -> None:
    """A role without a worker is almost always a misspelt name (``roles.trian.procs=2`` creates role
    ``trian``): name the roles there are and the closest one, instead of "missing required key 'worker'"."""
    roles = data.get("roles")
    if not isinstance(roles, dict):
        return
    named = sorted(k for k, v in roles.items() if isinstance(v, dict) and "worker" in v)
    for name, role in roles.items():
        if isinstance(role, dict) and "worker" not in role:
            close = difflib.get_close_matches(str(name), named, n=1)
            raise ConfigError(
                f"unknown role {name!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; roles: {', '.join(named) or 'none'}; a new role needs "
                f"roles.{name}.worker=package.module:Class"
            )


def load(data: dict[str, Any]) -> ExperimentConfig:
    _check_role_names(data)
    cfg = from_dict(ExperimentConfig, data, "config")
    validate(cfg)
    return cfg


def missing_inputs(cfg: ExperimentConfig) -> list[str]:
    """The model directories the run would load that are not there: one message per path, naming its keys.

    Every ``model_dir`` of the pipeline's and the roles' options must be a directory with a config.json,
    unless the pipeline's ``prepare`` builds it (its ``prepared_paths``, e.g. the RLVR warm start). Not part
    of ``load``: ``rollhpc plan`` and ``submit --dry-run`` describe configs whose models live on the cluster
    (configs/qwen2.5-7b_grpo.yaml), so ``rollhpc train`` and ``submit`` refuse these and the others warn.
    Without the check a missing model fails only once the world is up, in a worker's start-up.
    """
    pipeline = import_spec(cfg.pipeline.entry, "pipeline.entry")
    built = pipeline.prepared_paths(cfg.pipeline.options)
    prepared = {Path(p).expanduser().resolve() for p in built}
    keys_by_path: dict[Path, list[str]] = {}
    options = [("pipeline.options", cfg.pipeline.options)]
    options += [(f"roles.{name}.options", role.options) for name, role in cfg.roles.items()]
    for where, opts in options:
        model_dir = getattr(opts, "model_dir", None)
        if not isinstance(model_dir, str):
            continue
        path = Path(model_dir).expanduser().resolve()
        if path not in prepared and not (path / "config.json").is_file():
            keys_by_path.setdefault(path, []).append(f"{where}.model_dir")
    hints = ["point it at a local copy of the model", "build a tiny one with `rollhpc sft DIR`"]
    if hasattr(cfg.pipeline.options, "warm_start"):
        hints.append("set pipeline.options.warm_start to build it at start")
    hint = f"{', '.join(hints[:-1])} or {hints[-1]}"
    problems = []
    for path, keys in keys_by_path.items():
        what = f"{path} has no config.json" if path.is_dir() else f"no model directory at {path}"
        problems.append(f"{', '.join(keys)}: {what} (a Hugging Face checkpoint directory: {hint})")
    # dataset files the pipeline reads (the files task)
    data_paths = getattr(pipeline, "data_paths", None)
    for key, data in data_paths(cfg.pipeline.options) if data_paths is not None else []:
        if not Path(data).expanduser().is_file():
            problems.append(f"{key}: no dataset file at {data}")
    return problems


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
