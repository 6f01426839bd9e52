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
    # ${range:a,b} -> [a, ..., b-1]: device lists of thousands of GPUs without writing them out
    OmegaConf.register_new_resolver("range", lambda a, b: list(range(int(a), int(b))), replace=True)
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = hydra_compose(config_name=name, overrides=overrides)
        return OmegaConf.to_container(composed, resolve=True)  # type: ignore[return-value]
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot apply overrides {overrides}: {e}") from e


def load_experiment(experiment: str, overrides: list[str]) -> ExperimentConfig:
    return config_mod.load(compose(experiment, overrides))


def _prepare_run_dir(cfg: ExperimentConfig, plan, overwrite: bool) -> Path:
    run_dir = cfg.run.run_dir.resolve()
    if run_dir.exists():
        if not overwrite:
            raise ConfigError(f"run directory {run_dir} exists; pick another run.name=... or pass --overwrite")
        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False))
    plan.save(run_dir / "plan.json")
    return run_dir


def _prepare_inputs(cfg: ExperimentConfig) -> None:
    """Inputs the ranks load at start-up, made before any process starts (e.g. the quickstart's SFT
    warm start): the pipeline's ``prepare`` classmethod, when it has one."""
    pipeline_cls = config_mod.import_object(cfg.pipeline.entry, "pipeline.entry")
    prepare = getattr(pipeline_cls, "prepare", None)
    if prepare is not None:
        try:
            prepare(cfg.pipeline.options, cfg.run.seed)
        except (FileExistsError, FileNotFoundError, ValueError) as e:  # ConfigError included
            raise ConfigError(f"preparing the run's inputs: {e}") from e


def cmd_train(args: argparse.Namespace) -> int:
    from rollhpc.launch.local import build_command, failure_summary, local_plan, run_local

    cfg = load_experiment(args.experiment, args.overrides)
    plan = local_plan(cfg)
    if args.dry_run:
        print(" ".join(build_command(cfg, plan, cfg.run.run_dir.resolve())))
        return 0
    _prepare_inputs(cfg)
    run_dir = _prepare_run_dir(cfg, plan, args.overwrite)
    print(f"rollhpc: run {cfg.run.name}: {cfg.world_size()} MPI ranks, output in {run_dir}", file=sys.stderr)
    rc = run_local(cfg, plan, run_dir)
    if rc != 0 or (run_dir / "error.json").exists():
        print(f"rollhpc: run failed: {failure_summary(run_dir, rc)}", file=sys.stderr)
        return 1
    print(f"rollhpc: run {cfg.run.name} finished; metrics in {run_dir / 'metrics.jsonl'}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from rollhpc.launch.device_mapping import plan_world
    from rollhpc.launch.plan_report import render

    cfg = load_experiment(args.experiment, args.overrides)
    plan = plan_world(cfg)
    if args.json:
        print(plan.to_json())
        return 0
    for line in render(cfg, plan, ranks=not args.no_ranks, groups=args.groups, max_groups=args.max_groups):
        print(line)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from rollhpc.launch.device_mapping import plan_world
    from rollhpc.launch.local import failure_summary
    from rollhpc.launch.slurm import render_sbatch, submit, wait_for_job

    cfg = load_experiment(args.experiment, args.overrides)
    plan = plan_world(cfg)  # an impossible mapping fails here, before anything reaches Slurm
    if args.dry_run:
        print(render_sbatch(cfg, plan, cfg.run.run_dir.resolve()))
        return 0
    missing = [tool for tool in ("sbatch", "srun", "sacct") if not shutil.which(tool)]
    if missing:
        print(f"rollhpc submit: {', '.join(missing)} not found: run it on a Slurm login node (or add --dry-run "
              f"to see the batch script)", file=sys.stderr)
        return 2
    _prepare_inputs(cfg)
    run_dir = _prepare_run_dir(cfg, plan, args.overwrite)
    job = submit(cfg, plan, run_dir)
    (run_dir / "slurm" / "job_id").write_text(job.job_id + "\n")
    print(f"rollhpc: submitted job {job.job_id}: {plan.world_size} ranks in {len(plan.components)} het group(s); "
          f"output in {run_dir}", file=sys.stderr)
    if not args.wait:
        return 0
    state = wait_for_job(job.job_id)
    if state != "COMPLETED" or (run_dir / "error.json").exists():
        print(f"rollhpc: job {job.job_id} ended {state}: {failure_summary(run_dir, 1)}", file=sys.stderr)
        return 1
    print(f"rollhpc: job {job.job_id} completed; metrics in {run_dir / 'metrics.jsonl'}", file=sys.stderr)
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

    pl = sub.add_parser("plan", help="print where every rank of every role runs (node, GPUs, het group) and its "
                        "parallel groups", description="Validate an experiment's device mapping against its cluster "
                        "description (cluster.nodes, cluster.gpus_per_node, ...) and print the plan, without "
                        "starting or submitting anything. Impossible mappings fail with one message.")
    experiment_args(pl)
    pl.add_argument("--groups", action="store_true", help="also print each role's parallel groups (tp, cp, dp, pp, ...)")
    pl.add_argument("--max-groups", type=int, default=4, help="groups shown per kind (0 = all; default 4)")
    pl.add_argument("--no-ranks", action="store_true", help="omit the per-rank table")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    sb = sub.add_parser("submit", help="submit an experiment to Slurm as one heterogeneous job",
                        description="Plan the experiment on cluster.* (nodes, GPUs per node, partition...), then "
                        "submit one heterogeneous Slurm job (one component per placement group) whose single MPMD "
                        "srun starts the controller and every worker in one MPI world. Run from a login node; "
                        "runs/NAME must be on a filesystem the compute nodes share.")
    experiment_args(sb)
    sb.add_argument("--dry-run", action="store_true", help="print the sbatch script and exit")
    sb.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 only if the run succeeded")
    sb.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same name")
    sb.set_defaults(func=cmd_submit)

    for name, text in (("convert", "convert checkpoints between Megatron and Hugging Face formats"),
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
    if stray and args.command not in ("convert", "ckpt"):
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
