"""``rollhpc``: the command line. The only module that imports hydra.

Hydra composes configs/EXP.yaml (or a YAML path) with ``key=value`` overrides; the result is
handed to rollhpc.config as a plain dict and validated there, so the library never sees hydra.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from rollhpc import config as config_mod
from rollhpc.config import ConfigError, ExperimentConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def compose(experiment: str, overrides: list[str]) -> dict[str, Any]:
    """Experiment name (configs/NAME.yaml) or path to a YAML file, plus hydra overrides -> dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(experiment)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"no such config file: {path}")
        config_dir, name = path.resolve().parent, path.stem
    else:
        config_dir, name = CONFIG_DIR, experiment
        if not (config_dir / f"{name}.yaml").exists():
            known = sorted(p.stem for p in config_dir.glob("*.yaml"))
            raise ConfigError(f"unknown experiment {experiment!r}; known: {', '.join(known)} (or a path to a .yaml)")
    # `key=value` may set a key the YAML leaves to its dataclass default (roles.train.parallel.tp=2):
    # hydra would refuse it as new, so every plain override becomes "add or override" (++) and
    # rollhpc.config then rejects keys that exist nowhere, naming the valid ones.
    overrides = [o if o.startswith(("+", "~")) else f"++{o}" for o in overrides]
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = hydra_compose(config_name=name, overrides=overrides)
        return OmegaConf.to_container(composed, resolve=True)  # type: ignore[return-value]
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot apply overrides {overrides}: {e}") from e


def load_experiment(experiment: str, overrides: list[str]) -> ExperimentConfig:
    return config_mod.load(compose(experiment, overrides))


def _prepare_run_dir(cfg: ExperimentConfig, overwrite: bool) -> Path:
    run_dir = cfg.run.run_dir.resolve()
    if run_dir.exists():
        if not overwrite:
            raise ConfigError(f"run directory {run_dir} exists; pick another run.name=... or pass --overwrite")
        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False))
    return run_dir


def cmd_train(args: argparse.Namespace) -> int:
    from rollhpc.launch.local import build_command, failure_summary, run_local

    cfg = load_experiment(args.experiment, args.overrides)
    if args.dry_run:
        print(" ".join(build_command(cfg, cfg.run.run_dir.resolve())))
        return 0
    run_dir = _prepare_run_dir(cfg, args.overwrite)
    print(f"rollhpc: run {cfg.run.name}: {cfg.world_size()} MPI ranks, output in {run_dir}", file=sys.stderr)
    rc = run_local(cfg, run_dir)
    if rc != 0 or (run_dir / "error.json").exists():
        print(f"rollhpc: run failed: {failure_summary(run_dir, rc)}", file=sys.stderr)
        return 1
    print(f"rollhpc: run {cfg.run.name} finished; metrics in {run_dir / 'metrics.jsonl'}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = load_experiment(args.experiment, args.overrides)
    print(f"experiment {cfg.run.name}: {cfg.world_size()} MPI ranks")
    print(f"{'rank':>5}  {'role':<12} {'group':>5}  {'tp':>3} {'cp':>3} {'dp':>3} {'pp':>3}  dp-leader")
    print(f"{0:>5}  {'controller':<12} {0:>5}")
    rank = 1
    for name, role in cfg.roles.items():
        for c in role.layout().all_coords():
            print(f"{rank:>5}  {name:<12} {c.group_rank:>5}  {c.tp_rank:>3} {c.cp_rank:>3} {c.dp_rank:>3} "
                  f"{c.pp_rank:>3}  {'yes' if c.is_dp_leader else ''}")
            rank += 1
    return 0


def cmd_not_yet(args: argparse.Namespace) -> int:
    print(f"rollhpc {args.command}: not implemented in this version of rollhpc yet", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollhpc",
        description="RL post-training of language models on Slurm/HPC: a single controller drives worker "
        "groups (train, generate, reference, critic, reward, env) over MPI.",
        epilog="Experiments are configs/NAME.yaml or a path to a YAML file; append key=value overrides "
        "(hydra syntax), e.g. `rollhpc train quickstart pipeline.options.steps=10`.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def experiment_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("experiment", help="experiment name in configs/ or path to a .yaml")
        sp.add_argument("overrides", nargs="*", help="hydra overrides, key=value")

    t = sub.add_parser("train", help="run an experiment here, as one MPI world started with mpiexec",
                       description="Run an experiment on this machine: rank 0 is the controller, the other "
                       "ranks serve the configured roles. Writes runs/NAME/ (config.yaml, metrics.jsonl, "
                       "logs/ per rank, error.json on failure).")
    experiment_args(t)
    t.add_argument("--dry-run", action="store_true", help="print the mpiexec command and exit")
    t.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same name")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plan", help="print which MPI rank serves which role, and its parallel coordinates",
                        description="Validate an experiment and print its rank layout without starting anything.")
    experiment_args(pl)
    pl.set_defaults(func=cmd_plan)

    for name, text in (("submit", "submit an experiment to Slurm as one heterogeneous job"),
                       ("convert", "convert checkpoints between Megatron and Hugging Face formats"),
                       ("ckpt", "list, inspect and verify checkpoints")):
        sp = sub.add_parser(name, help=f"{text} (not implemented yet)")
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(func=cmd_not_yet)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come after flags (`train quickstart --overwrite a.b=1`): collect them too
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray and args.command not in ("submit", "convert", "ckpt"):
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"rollhpc: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
