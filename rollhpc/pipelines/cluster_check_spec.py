"""The cluster check's plan-time side (rollhpc.protocol.spec): its options, the loader that wraps the checked
experiment, and the checked pipeline's class hooks. What config loading, ``rollhpc plan`` and ``submit --dry-run``
read; the run is rollhpc.pipelines.cluster_check.

``configs/cluster_check.yaml`` names the experiment it checks (``check.experiment``, default quickstart); the
loader (``wrap_experiment``, called by rollhpc.cli.experiment) takes that experiment's roles, cluster, controller
and launch sections as they are, so the check runs on the very het groups, nodes, GPUs and cores the real run
would get, and wraps its pipeline.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from rollhpc import config as config_mod
from rollhpc.pipelines.training_spec import TrainingPipelineSpec
from rollhpc.protocol.spec import PipelineSpec

__all__ = [
    "DIAGNOSTIC_WORKER",
    "ENTRY",
    "ClusterCheckSpec",
    "split_overrides",
    "step_options",
    "wrap_experiment",
]

DIAGNOSTIC_WORKER = "rollhpc.workers.diagnostic:DiagnosticWorker"
ENTRY = "rollhpc.pipelines.cluster_check:ClusterCheck"  # the runtime class a wrapped config names
# the keys of the check's own file; every other override goes to the checked experiment
OWN_KEYS = ("check", "run")


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``check.*`` and ``run.*`` overrides belong to the check's file, the rest (cluster.*, roles.*, pipeline.*)
    to the checked experiment."""
    own, rest = [], []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        (own if key.split(".", 1)[0] in OWN_KEYS else rest).append(o)
    return own, rest


def wrap_experiment(
    check: dict[str, Any], target: dict[str, Any], time_limit_given: bool = False
) -> dict[str, Any]:
    """The check's config from its own file's ``check`` and ``run`` sections and the checked experiment's
    composed dict: the experiment's roles, cluster, controller and launch as they are, its pipeline wrapped.
    When the experiment's inputs (models, data) are not there, its roles become DiagnosticWorkers on the same
    layout and the RL step is skipped, saying why. The job asks for ``check.time_limit``, not the experiment's
    days, unless the command line gave ``cluster.time_limit`` (``time_limit_given``): a short job starts sooner."""
    own = dict(check.get("check") or {})
    limit = own.pop("time_limit", None)
    name = str(own.get("experiment", ""))
    pipeline = target.get("pipeline") or {}
    if pipeline.get("entry", "").endswith(":ClusterCheck"):
        raise config_mod.ConfigError(
            f"check.experiment: {name!r} is a cluster check itself; name the experiment "
            "whose layout to check"
        )
    out = copy.deepcopy(target)
    out["run"] = {**(target.get("run") or {}), **(check.get("run") or {})}
    if limit and not time_limit_given:
        out["cluster"] = {**(out.get("cluster") or {}), "time_limit": str(limit)}
    missing = _missing_inputs(target)
    if missing:
        own["skip_step"] = "; ".join(missing)
        for role in out.get("roles", {}).values():
            role.update(worker=DIAGNOSTIC_WORKER, options={})
    out["pipeline"] = {
        "entry": ENTRY,
        "options": {**own, "pipeline": copy.deepcopy(pipeline)},
    }
    return out


def _missing_inputs(target: dict[str, Any]) -> list[str]:
    """What the checked experiment would load and is not here (config.missing_inputs of it)."""
    cfg = config_mod.load(copy.deepcopy(target))
    return config_mod.missing_inputs(cfg)


class ClusterCheckSpec(PipelineSpec):
    """The cluster check before it runs (its runtime: rollhpc.pipelines.cluster_check.ClusterCheck).

    ``memory_stages`` are the training pipelines' (rlvr, agentic), whose GPU configs are the ones worth checking:
    ``rollhpc plan`` reads them from the entry's class, so a colocated config plans as it would for its real run.
    """

    memory_stages = TrainingPipelineSpec.memory_stages

    @dataclass(kw_only=True)
    class Options:
        experiment: str = ""  # the checked experiment (its name or path: the table's title)
        # its pipeline section: entry and options
        pipeline: dict[str, Any] = field(default_factory=dict)
        allreduce_mib: list[float] = field(default_factory=lambda: [1.0, 16.0, 64.0])
        iters: int = 5  # timed collectives per size (after one warm-up)
        # the fabric's bus bandwidth within a node (0: measure only)
        expected_intra_node_gbps: float = 0.0
        expected_inter_node_gbps: float = 0.0  # ... and between nodes
        expected_weight_sync_gbps: float = 0.0  # trainer -> generators
        bandwidth_floor: float = 0.5  # a measurement below this share of the expected one fails
        weight_sync_mib: float = 256.0  # the trainer -> generators broadcast's size
        # take one step of the checked pipeline (timed, with its real weight sync)
        rl_step: bool = True
        skip_step: str = ""  # set by the loader: why the step cannot run here (the model is absent)
        # a failed row ends the run with an error (after the table is written)
        fail_on_mismatch: bool = True

        def __post_init__(self) -> None:
            if self.iters < 1 or not self.allreduce_mib or min(self.allreduce_mib) <= 0:
                raise ValueError("iters must be >= 1 and allreduce_mib a list of positive sizes")
            if not 0 < self.bandwidth_floor <= 1:
                raise ValueError(f"bandwidth_floor: a share in (0, 1], not {self.bandwidth_floor}")

        @functools.cached_property
        def checked(self) -> object | None:
            """The checked pipeline's own options (validated), or None when its roles are model-free here."""
            return None if self.skip_step else ClusterCheckSpec.wrapped(self)[1]

        # What start-up, ``rollhpc plan`` and the load-time checks read off ``cfg.pipeline.options``
        # (rank.py's start-up turns, placement's memory plan and weight-sync routing): the checked pipeline's
        # values, so that the check starts its GPUs in the same turns and is planned as its real run would be.
        offload = property(lambda self: bool(getattr(self.checked, "offload", False)))
        weight_sync = property(lambda self: getattr(self.checked, "weight_sync", None))
        weight_sync_bucket_mb = property(
            lambda self: getattr(self.checked, "weight_sync_bucket_mb", None)
        )
        rollout = property(lambda self: getattr(self.checked, "rollout", None))
        eval_max_tokens = property(lambda self: getattr(self.checked, "eval_max_tokens", None))

    # ---- the checked pipeline's class hooks, so that its inputs are checked and built as for its real run
    @staticmethod
    def wrapped(
        options: ClusterCheckSpec.Options, runtime: bool = False
    ) -> tuple[type[PipelineSpec], object]:
        """The checked pipeline's class and its options for one step (``step_options``), validated: its spec for
        the plan-time hooks (no heavy import on a login node), its runtime class for the ``run``."""
        entry = options.pipeline.get("entry", "")
        load = config_mod.import_object if runtime else config_mod.import_spec
        cls = load(entry, "pipeline.options.pipeline.entry")
        raw = step_options(cls, options.pipeline.get("options") or {})
        return cls, config_mod.component_options(cls, raw, "pipeline.options.pipeline.options")

    @classmethod
    def check_roles(cls, options: ClusterCheckSpec.Options, roles: dict[str, Any]) -> None:
        """The checked pipeline's role checks (none for the model-free stand-ins)."""
        if not options.skip_step:
            inner, opts = cls.wrapped(options)
            inner.check_roles(opts, roles)

    @classmethod
    def prepare(
        cls, options: ClusterCheckSpec.Options, seed: int, roles: dict[str, Any] | None = None
    ) -> None:
        """What the checked pipeline builds before the world starts (a warm start, data), as its real run would."""
        if not options.skip_step:
            inner, opts = cls.wrapped(options)
            inner.prepare(opts, seed, roles)

    @classmethod
    def prepared_paths(cls, options: ClusterCheckSpec.Options) -> list[str]:
        """The checked pipeline's: what ``prepare`` will build, so the load does not call it missing."""
        if options.skip_step:
            return []
        inner, opts = cls.wrapped(options)
        return inner.prepared_paths(opts)

    @classmethod
    def data_paths(cls, options: ClusterCheckSpec.Options) -> list[tuple[str, str]]:
        """The checked pipeline's data files, checked at load as for its real run."""
        inner, opts = cls.wrapped(options) if not options.skip_step else (None, None)
        fn = getattr(inner, "data_paths", None)
        return list(fn(opts)) if fn is not None else []


def step_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The checked pipeline's options for one step: ``steps`` 1, and what would outlast it off (rollouts,
    checkpoints and resuming from one, the final export), for the options that pipeline has."""
    names = (
        {f.name for f in dataclasses.fields(getattr(cls, "Options"))}
        if hasattr(cls, "Options")
        else set()
    )
    out = copy.deepcopy(options)
    for key, value in (("steps", 1), ("rollout_every", 0), ("export_hf", "none")):
        if key in names:
            out[key] = value
    if "checkpoint" in names:
        out["checkpoint"] = {
            **(out.get("checkpoint") or {}),
            "at_end": False,
            "resume": False,
            "every": 0,
        }
    return out
