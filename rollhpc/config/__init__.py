"""Typed experiment configuration, validated when it is loaded.

Hydra composes YAML and applies overrides at the CLI boundary; what reaches the library is a plain
dict, turned here into dataclasses. Every mistake is reported before any process starts, naming
the dotted key: unknown keys list the valid ones, wrong types say what was expected.
Components (the pipeline, each role's worker) are named by import path and carry an ``options``
mapping that is validated against the component's own ``Options`` dataclass.

Here: the experiment's sections and the checks across them (``load``, ``validate``). The Slurm cluster's
sections are ``config.cluster`` and ``config.container``; turning a dict into a dataclass is ``config.loading``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollhpc.config.cluster import ClusterConfig
from rollhpc.config.loading import ConfigError, component_options, from_dict
from rollhpc.parallel import ParallelLayout
from rollhpc.protocol.spec import PipelineSpec, WorkerSpec, find_spec

CONTROLLER_ROLE = "controller"


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
    options: object = field(default_factory=dict)
    # Environment variables of this role's ranks, set when a rank learns its role, before the role's modules
    # load (torch and its OpenMP runtime read theirs at load): e.g. OMP_WAIT_POLICY=PASSIVE where roles share
    # cores at the same time (async generation), VLLM_* for a generator, NCCL_* for a trainer
    env_vars: dict[str, Any] = field(default_factory=dict)  # values: strings or numbers

    def layout(self) -> ParallelLayout:
        # ParallelConfig's fields are ParallelLayout's, less the rank count
        return ParallelLayout(world=self.procs, **dataclasses.asdict(self.parallel))


@dataclass(kw_only=True)
class PipelineConfig:
    entry: str  # "package.module:Class", a subclass of rollhpc.protocol.pipeline.Pipeline
    # a mapping; after load, the pipeline's Options instance
    options: object = field(default_factory=dict)


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


def import_object(path: str, where: str) -> object:
    module, name = _split_import_path(path, where)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import {path!r}: {e}") from e


def import_spec(path: str, where: str) -> object:
    """The plan-time side of the worker or pipeline ``path`` names (rollhpc.protocol.spec): its spec class, found
    without importing the runtime module, or the runtime class itself when it has no spec. What config loading,
    ``plan`` and ``submit --dry-run`` read, so that they import no torch, megatron or vllm."""
    module, name = _split_import_path(path, where)
    try:
        spec = find_spec(module, name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import the spec of {path!r}: {e}") from e
    return spec if spec is not None else import_object(path, where)


def validate(cfg: ExperimentConfig) -> None:
    """Cross-field checks and component resolution: everything that can fail before launch."""
    if not cfg.roles:
        raise ConfigError("roles: an experiment needs at least one worker role")
    if CONTROLLER_ROLE in cfg.roles:
        raise ConfigError(f"roles.{CONTROLLER_ROLE}: the name is reserved for rank 0")
    for name, role in cfg.roles.items():
        _check_role(name, role)
        _resolve_worker(f"roles.{name}", role)
    _resolve_pipeline(cfg)
    _check_token_budget(cfg)
    _check_controller(cfg.controller)


def _check_role(name: str, role: RoleConfig) -> None:
    """A role's own numbers: its name, ranks, CPUs and GPUs per rank, environment variables and layout."""
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
        if not (isinstance(key, str) and key.replace("_", "a").isalnum() and not key[0].isdigit()):
            raise ConfigError(f"{where}.env_vars: {key!r} is not an environment variable name")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}.env_vars.{key}: give a string (or number), got {value!r}")
    role.env_vars = {k: str(v) for k, v in role.env_vars.items()}
    try:
        role.layout()
    except ValueError as e:
        raise ConfigError(f"{where}.parallel: {e}") from e


def _resolve_worker(where: str, role: RoleConfig) -> None:
    """Find the role's worker spec, check its layout and model against it, and turn ``options`` into the
    worker's ``Options``."""
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
    if role.gpus_per_proc > 0 and isinstance(engine_tp, int) and engine_tp != role.gpus_per_proc:
        raise ConfigError(
            f"{where}.options.tensor_parallel_size={engine_tp} but {where}.gpus_per_proc="
            f"{role.gpus_per_proc}: each rank's engine spreads over the GPUs its rank gets (the "
            "memory plan counts them so); set both the same"
        )


def _resolve_pipeline(cfg: ExperimentConfig) -> None:
    """Find the pipeline's spec, turn its ``options`` into its ``Options`` and check the roles it needs."""
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


_POSITIVE_TIMEOUTS = (
    "call_timeout_s",
    "world_timeout_s",
    "startup_timeout_s",
    "stack_dump_timeout_s",
    "shutdown_timeout_s",
    "mpi_stall_s",
)


def _check_controller(controller: ControllerConfig) -> None:
    for name in _POSITIVE_TIMEOUTS:
        if getattr(controller, name) <= 0:
            raise ConfigError(
                f"controller.{name}: must be positive, got {getattr(controller, name)}"
            )
    if controller.peer_loss_settle_s < 0:
        raise ConfigError(
            f"controller.peer_loss_settle_s: must be >= 0, got {controller.peer_loss_settle_s}"
        )


def generator_max_model_len(roles: Mapping[str, RoleConfig] | None) -> int | None:
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


def to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
