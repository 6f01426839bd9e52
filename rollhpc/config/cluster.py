"""``cluster``: the Slurm cluster a run is planned for and submitted to, in Slurm's own syntax, checked at load."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rollhpc.config.container import ContainerConfig
from rollhpc.config.loading import ConfigError


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
    # CPUs of one of its nodes (how many ranks share one); 0: cluster.cpus_per_node
    cpus_per_node: int = 0
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
    # restarts after failures (lost workers, peers or nodes, a world that did not form, a job Slurm ended) before
    # the run gives up; continuations after a time limit do not count (a four-week run of 48-hour jobs has 13)
    max_restarts: int = 5
    # continuations after a time limit before the run ends (its checkpoint kept; slurm/resume.sh continues it):
    # a site's bound on a run's jobs; null (the default): none
    max_continuations: int | None = None
    # the partition of the rescue jobs (one CPU for seconds, only after a job ended); empty: the CPU component's
    rescue_partition: str = ""
    # time-limit warning: checkpoint and requeue this long before the end (0: off)
    stop_before_limit_s: int = 300
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
            or (self.max_continuations is not None and self.max_continuations < 0)
            or self.stop_before_limit_s < 0
            or self.end_grace_s < 0
            or self.gpu_memory_gb < 0
        ):
            raise ValueError(
                "cluster.max_restarts, cluster.max_continuations, cluster.stop_before_limit_s, "
                "cluster.end_grace_s and "
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


def _check_slurm_names(section: object, where: str) -> None:
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
