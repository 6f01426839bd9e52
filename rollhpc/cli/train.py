"""``rollhpc train``: run an experiment here, as one MPI world started with mpiexec."""

from __future__ import annotations

import argparse
import sys

from rollhpc import config as config_mod
from rollhpc.cli.experiment import (
    check_inputs,
    experiment_args,
    reads_experiment,
    report_end,
    run_dir_args,
    start_run,
)
from rollhpc.config import ConfigError, ExperimentConfig
from rollhpc.launch.local import build_command, local_plan, run_local
from rollhpc.launch.requeue import EXIT_REQUEUE
from rollhpc.placement.device_mapping import plan_world


@reads_experiment
def cmd_train(cfg: ExperimentConfig, args: argparse.Namespace) -> int:
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
    run_dir = start_run(cfg, plan, args)
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
    return report_end(run_dir, rc == 0, rc, "run failed", f"run {cfg.run.name} finished")


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
    run_dir_args(
        t,
        resume_help="continue an existing run directory (same configuration) from its newest good checkpoint; "
        "SIGUSR1 to this command makes the run checkpoint after its current step and stop (exit 75)",
    )
    t.set_defaults(func=cmd_train)
