"""Reading an experiment: hydra composes configs/EXP.yaml (or a YAML path) with ``key=value`` overrides; the
result is handed to rollhpc.config as a plain dict and validated there, so the library never sees hydra (this is
the only module that imports it). Also what train, plan and submit share: loading the experiment (or printing it), the run directory and the
inputs, and how a run's end is reported."""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollhpc import config as config_mod
from rollhpc import experiments
from rollhpc.config import ConfigError, ExperimentConfig
from rollhpc.launch.local import failure_summary
from rollhpc.pipelines.cluster_check_spec import split_overrides, wrap_experiment
from rollhpc.placement.device_mapping import WorldPlan
from rollhpc.rundir import RunPaths, atomic_write_bytes, atomic_write_text


def experiment_args(sp: argparse.ArgumentParser) -> None:
    """The arguments every command that reads an experiment takes."""
    sp.add_argument(
        "experiment", help="experiment name (`rollhpc configs` lists them) or path to a .yaml"
    )
    sp.add_argument("overrides", nargs="*", help="hydra overrides, key=value")
    sp.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (the YAML "
        "with the overrides applied and every default filled in, as the run's config.yaml will "
        "hold it) and exit",
    )


def reads_experiment(
    run: Callable[[ExperimentConfig, argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """The ``cmd_*`` of a command that takes ``experiment_args``: ``run(cfg, args)`` with the experiment loaded,
    or, given --print-config, only that printed."""

    @functools.wraps(run)
    def cmd(args: argparse.Namespace) -> int:
        cfg = load_experiment(args.experiment, args.overrides)
        if args.print_config:
            return print_config(cfg)
        return run(cfg, args)

    return cmd


def run_dir_args(sp: argparse.ArgumentParser, resume_help: str) -> None:
    """--overwrite and --resume, what ``start_run`` does with an existing run directory."""
    sp.add_argument(
        "--overwrite", action="store_true", help="delete an existing run directory of the same name"
    )
    sp.add_argument("--resume", action="store_true", help=resume_help)


def start_run(
    cfg: ExperimentConfig,
    plan: WorldPlan,
    args: argparse.Namespace,
    on_resume: Callable[[Path], None] | None = None,
) -> Path:
    """What train and submit do before the world starts: the inputs prepared and the run directory made, or
    checked for --resume (after ``on_resume(run_dir)``, when given); returns the run directory."""
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if args.resume and on_resume is not None:
        on_resume(cfg.run.run_dir.resolve())
    prepare_inputs(cfg)
    return prepare_run_dir(cfg, plan, args.overwrite, args.resume)


def report_end(run_dir: Path, ended_ok: bool, rc: int, failed: str, finished: str) -> int:
    """The line train and submit --wait print once the run has ended, and their exit status: ``rollhpc: FAILED:
    why`` and 1 if it did not end well or wrote error.json (``rc``, its exit status, goes into the why), else
    ``rollhpc: FINISHED; metrics in ...`` and 0."""
    if not ended_ok or RunPaths(run_dir).error.exists():
        print(f"rollhpc: {failed}: {failure_summary(run_dir, rc)}", file=sys.stderr)
        return 1
    print(f"rollhpc: {finished}; metrics in {RunPaths(run_dir).metrics}", file=sys.stderr)
    return 0


def compose(experiment: str, overrides: list[str]) -> dict[str, Any]:
    """Experiment name (configs/NAME.yaml) or path to a YAML file, plus hydra overrides -> dict.

    A file with a top-level ``check`` section (configs/cluster_check.yaml) is a cluster check of another
    experiment: that one is composed with the overrides that are not ``check.*`` / ``run.*`` and wrapped
    (rollhpc.pipelines.cluster_check.wrap_experiment), so the check runs on its exact layout."""
    path = experiment_path(experiment)
    check_yaml_syntax(path)
    check_override_syntax(overrides)
    if "check" in (yaml.safe_load(path.read_text()) or {}):
        own, rest = split_overrides(overrides)
        check = _hydra_compose(path, own)
        target = (check.get("check") or {}).get("experiment") or "quickstart"
        given = any(o.lstrip("+~").split("=", 1)[0] == "cluster.time_limit" for o in rest)
        return wrap_experiment(check, compose(str(target), rest), time_limit_given=given)
    return _hydra_compose(path, overrides)


def experiment_path(experiment: str) -> Path:
    """The YAML file an experiment name or path stands for (ConfigError naming the known ones when none)."""
    path = Path(experiment)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"no such config file: {path}")
    else:
        found = experiments.find(experiment)
        if found is None:
            known = [e.name for e in experiments.available()]
            raise ConfigError(
                f"unknown experiment {experiment!r}; known: {', '.join(known)} (or a path to a .yaml; "
                f"`rollhpc configs` lists them with where they are)"
            )
        path = found
    return path


def _hydra_compose(path: Path, overrides: list[str]) -> dict[str, Any]:
    """One YAML file (its defaults list included) with hydra overrides applied and interpolations resolved."""
    config_dir, name = path.resolve().parent, path.stem
    # `key=value` may set a key the YAML leaves to its dataclass default (roles.train.parallel.tp=2):
    # hydra would refuse it as new, so every plain override becomes "add or override" (++) and
    # rollhpc.config then rejects keys that exist nowhere, naming the valid ones.
    overrides = [o if o.startswith(("+", "~")) else f"++{o}" for o in overrides]
    # ${range:a,b} -> [a, ..., b-1]: device lists of thousands of GPUs without writing them out
    OmegaConf.register_new_resolver("range", lambda a, b: list(range(int(a), int(b))), replace=True)
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = hydra_compose(config_name=name, overrides=overrides)
        return OmegaConf.to_container(composed, resolve=True)  # type: ignore[return-value]
    except yaml.YAMLError as e:  # a file the experiment's defaults list pulls in
        raise ConfigError(yaml_error_line(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot apply overrides {overrides}: {' '.join(str(e).split())}") from e


def yaml_error_line(e: yaml.YAMLError, path: Path | None = None) -> str:
    """A YAML syntax error as one line: FILE:LINE:COLUMN: what is wrong (and what to do about a tab)."""
    mark = getattr(e, "problem_mark", None)
    where = str(path or (mark.name if mark else "config"))
    if mark is not None:
        where += f":{mark.line + 1}:{mark.column + 1}"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if "'\\t'" in problem or "\t" in problem:
        problem += " (YAML indents with spaces, never tabs)"
    return f"{where}: YAML syntax: {problem}"


def check_yaml_syntax(path: Path) -> None:
    """Parse the experiment's file before hydra does: hydra's own error is an 80-line traceback."""
    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_line(e, path)) from None


def check_override_syntax(overrides: list[str]) -> None:
    """Each ``key=value`` through hydra's own override parser, so a bad one is named alone, in one line."""
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override if override.startswith(("+", "~")) else f"++{override}")
        except HydraException as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"override {override!r}: {first} (hydra syntax: key=value; quote a value with "
                f"brackets, commas or spaces, e.g. 'key=[1, 2]' or key=\"a b\")"
            ) from None


def load_experiment(experiment: str, overrides: list[str]) -> ExperimentConfig:
    return config_mod.load(compose(experiment, overrides))


def print_config(cfg: ExperimentConfig) -> int:
    print(yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False), end="")
    return 0


def prepare_run_dir(
    cfg: ExperimentConfig, plan: WorldPlan, overwrite: bool, resume: bool = False
) -> Path:
    run_dir = cfg.run.run_dir.resolve()
    if resume:
        return resume_run_dir(cfg, plan, run_dir)
    if run_dir.exists():
        if not overwrite:
            raise ConfigError(
                f"run directory {run_dir} exists; pick another run.name=..., pass --resume to "
                "continue it from its checkpoint, or --overwrite to start again"
            )
        shutil.rmtree(run_dir)
    RunPaths(run_dir).logs.mkdir(parents=True)
    atomic_write_text(
        RunPaths(run_dir).config, yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False)
    )
    plan.save(RunPaths(run_dir).plan)
    return run_dir


def resume_run_dir(cfg: ExperimentConfig, plan: WorldPlan, run_dir: Path) -> Path:
    """An existing run continues only with the configuration it was started with (its checkpoint's layout
    and data cursor depend on it); the world's processes find its newest good checkpoint themselves."""
    saved_path = RunPaths(run_dir).config
    if not saved_path.is_file():
        raise ConfigError(
            f"--resume: {run_dir} is not a run directory (no config.yaml); start it without --resume"
        )
    saved = yaml.safe_load(saved_path.read_text())
    # as config.yaml holds it
    now = yaml.safe_load(yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False))
    # where the run directory is was settled by finding it (a relative output_dir depends on the cwd), and
    # the machines (cluster.*: partition, time limit, nodes) do not change what a checkpoint holds
    # and export_hf only decides what is written after the last step (resuming a finished run with export_hf=final
    # exports it)
    differ = sorted(
        k
        for k in _differing_keys(saved, now)
        if k not in ("run.output_dir", "pipeline.options.export_hf")
        and not k.startswith("cluster.")
    )
    if differ:
        raise ConfigError(
            f"--resume: the configuration differs from the run's {saved_path} in "
            f"{', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}; resume with the same settings"
        )
    RunPaths(run_dir).error.unlink(missing_ok=True)  # the last attempt's failure is history now
    if now != saved:
        atomic_write_bytes(
            saved_path, yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False).encode()
        )
    plan.save(RunPaths(run_dir).plan)
    return run_dir


def _differing_keys(a: object, b: object, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two YAML trees (a key missing on one side differs)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differing_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def prepare_inputs(cfg: ExperimentConfig) -> None:
    """Inputs the ranks load at start-up, made before any process starts (e.g. the quickstart's SFT
    warm start): the pipeline's ``prepare`` classmethod."""
    pipeline_cls = config_mod.import_spec(cfg.pipeline.entry, "pipeline.entry")
    try:
        pipeline_cls.prepare(cfg.pipeline.options, cfg.run.seed, cfg.roles)
    except (FileExistsError, FileNotFoundError, ValueError) as e:  # ConfigError included
        raise ConfigError(f"preparing the run's inputs: {e}") from e


def check_inputs(cfg: ExperimentConfig, refuse: bool) -> None:
    """Model directories the run would load (``config.missing_inputs``): a run started without one fails only
    once its world is up, so ``train`` and ``submit`` refuse it here; ``plan`` and ``--dry-run`` only print, for
    a model that may exist on the cluster alone, and warn."""
    problems = config_mod.missing_inputs(cfg)
    if problems and refuse:
        raise ConfigError("; ".join(problems))
    for problem in problems:
        print(
            f"rollhpc: warning: {problem}; train and submit refuse to start without it",
            file=sys.stderr,
        )
