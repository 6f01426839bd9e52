"""``rollhpc submit``: an experiment as one heterogeneous Slurm job."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from rollhpc.cli.experiment import (
    check_inputs,
    experiment_args,
    reads_experiment,
    report_end,
    run_dir_args,
    start_run,
)
from rollhpc.config import ConfigError, ExperimentConfig
from rollhpc.launch.slurm import SubmissionRefused, render_sbatch, submit, wait_for_job
from rollhpc.launch.slurm_cli import TERMINAL, component_states
from rollhpc.placement.device_mapping import plan_world
from rollhpc.placement.memory_plan import estimate
from rollhpc.rundir import RunPaths


@reads_experiment
def cmd_submit(cfg: ExperimentConfig, args: argparse.Namespace) -> int:
    plan = plan_world(cfg)  # an impossible mapping fails here, before anything reaches Slurm
    if plan.gpus_total:
        estimate(cfg, plan).check()  # so does one that cannot fit in cluster.gpu_memory_gb
    check_inputs(cfg, refuse=not args.dry_run)
    if args.dry_run:
        print(render_sbatch(cfg, plan, cfg.run.run_dir.resolve()))
        return 0
    missing = [tool for tool in ("sbatch", "srun", "sacct") if not shutil.which(tool)]
    if missing:
        print(
            f"rollhpc submit: {', '.join(missing)} not found: run it on a Slurm login node (or add --dry-run "
            f"to see the batch script)",
            file=sys.stderr,
        )
        return 2
    new_run = args.overwrite or not cfg.run.run_dir.exists()
    run_dir = start_run(cfg, plan, args, on_resume=_refuse_if_job_active)
    try:
        # writes RUN_DIR/slurm/job_id and queues the job's rescue job
        job = submit(cfg, plan, run_dir)
    except SubmissionRefused as e:
        if new_run:  # nothing was queued: a retry starts as this one did, without --overwrite
            shutil.rmtree(run_dir, ignore_errors=True)
        kept = "" if new_run else f" ({run_dir} is as it was, but for its slurm/batch.sh)"
        print(f"rollhpc submit: sbatch refused the job: {e}{kept}", file=sys.stderr)
        return 2
    print(
        f"rollhpc: submitted job {job.job_id}: {plan.world_size} ranks in {len(plan.components)} het group(s); "
        f"output in {run_dir}",
        file=sys.stderr,
    )
    if not args.wait:
        return 0
    state = wait_for_job(job.job_id, release_held=cfg.cluster.release_held, run_dir=run_dir)
    return report_end(
        run_dir,
        state == "COMPLETED",
        1,
        f"job {job.job_id} ended {state}",
        f"job {job.job_id} completed",
    )


def _refuse_if_job_active(run_dir: Path) -> None:
    """Two jobs must never write one run directory: a resubmission waits until the last job has ended."""
    id_file = RunPaths(run_dir).job_id
    if not id_file.is_file():
        return
    job_id = id_file.read_text().strip()
    active = {c: st for c, st in component_states(job_id).items() if st not in TERMINAL}
    if active:
        raise ConfigError(
            f"--resume: job {job_id} of {run_dir} is still {sorted(set(active.values()))[0]} (it "
            f"continues the run by itself after a time limit or a lost node); wait for it to end or "
            f"`scancel {job_id}` first"
        )


def add_parser(sub: argparse._SubParsersAction) -> None:

    sb = sub.add_parser(
        "submit",
        help="submit an experiment to Slurm as one heterogeneous job",
        description="Plan the experiment on cluster.* (nodes, GPUs per node, partition...), then "
        "submit one heterogeneous Slurm job (one component per placement group) whose single MPMD "
        "srun starts the controller and every worker in one MPI world. Run from a login node; "
        "runs/NAME must be on a filesystem the compute nodes share.",
    )
    experiment_args(sb)
    sb.add_argument("--dry-run", action="store_true", help="print the sbatch script and exit")
    sb.add_argument(
        "--wait",
        action="store_true",
        help="wait for the job to end; exit 0 only if the run succeeded",
    )
    run_dir_args(
        sb,
        resume_help="submit a new job for an existing run directory (same configuration; its last job must "
        "have ended) that continues from the newest good checkpoint. Not needed after a time limit or a "
        "node failure: the job requeues itself (cluster.requeue, cluster.max_restarts)",
    )
    sb.set_defaults(func=cmd_submit)
