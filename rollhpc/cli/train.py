"""``rollhpc train``: run an experiment here, as one MPI world started with mpiexec."""

from __future__ import annotations

import argparse
import sys

from rollhpc import config as config_mod
from rollhpc.cli.experiment import (
    check_inputs,
    experiment_args,
    load_experiment,
    prepare_inputs,
    prepare_run_dir,
    print_config,
)
from rollhpc.config import ConfigError
from rollhpc.launch.local import build_command, failure_summary, local_plan, run_local
from rollhpc.launch.requeue import EXIT_REQUEUE
from rollhpc.placement.device_mapping import plan_world
from rollhpc.rundir import RunPaths


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_experiment(args.experiment, args.overrides)
    if args.print_config:
        return print_config(cfg)
    try:
        plan = local_plan(cfg)
    except ConfigError as e:
        if not args.dry_run:
            raise
        # a login node has no GPUs: the dry run still shows the command and the prompts, planned on cluster.*
        plan = plan_world(cfg)
        print(
            f"rollhpc: warning: {e}; planned on cluster.* instead (`rollhpc submit` runs it there)",
            file=sys.stderr,
        )
    check_inputs(cfg, refuse=not args.dry_run)
    if args.dry_run:
        print(" ".join(build_command(cfg, plan, cfg.run.run_dir.resolve())))
        pipeline_cls = config_mod.import_spec(cfg.pipeline.entry, "pipeline.entry")
        try:  # what the policy will be shown: chat template or plain text
            lines = pipeline_cls.preview(cfg.pipeline.options, roles=cfg.roles)
        except ValueError as e:  # a prompt that leaves no room for its response
            raise ConfigError(f"pipeline.options.task: {e}") from None
        if lines is not None:
            print("\n".join(lines))
        return 0
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    prepare_inputs(cfg)
    run_dir = prepare_run_dir(cfg, plan, args.overwrite, args.resume)
    print(
        f"rollhpc: run {cfg.run.name}: {cfg.world_size()} MPI ranks, output in {run_dir}",
        file=sys.stderr,
    )
    rc = run_local(cfg, plan, run_dir)
    if rc == EXIT_REQUEUE:
        print(
            f"rollhpc: run {cfg.run.name} stopped after saving a checkpoint (stop request); continue it with the "
            f"same command and --resume",
            file=sys.stderr,
        )
        return EXIT_REQUEUE
    if rc != 0 or RunPaths(run_dir).error.exists():
        print(f"rollhpc: run failed: {failure_summary(run_dir, rc)}", file=sys.stderr)
        return 1
    print(
        f"rollhpc: run {cfg.run.name} finished; metrics in {RunPaths(run_dir).metrics}",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:

    t = sub.add_parser(
        "train",
        help="run an experiment here, as one MPI world started with mpiexec",
        description="Run an experiment on this machine: rank 0 is the controller, the other "
        "ranks serve the configured roles. Writes runs/NAME/ (config.yaml, metrics.jsonl, "
        "logs/ per rank, error.json on failure).",
    )
    experiment_args(t)
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="print the mpiexec command and the first prompts as the "
        "policy will see them (chat template or plain text), then exit",
    )
    t.add_argument(
        "--overwrite", action="store_true", help="delete an existing run directory of the same name"
    )
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue an existing run directory (same configuration) from its newest good checkpoint; "
        "SIGUSR1 to this command makes the run checkpoint after its current step and stop (exit 75)",
    )
    t.set_defaults(func=cmd_train)
