"""``rollhpc status``: where a run stands and what, if anything, to do."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollhpc.launch import status
from rollhpc.launch.resubmit import rescue_jobs


def cmd_status(args: argparse.Namespace) -> int:
    try:
        run_dir = status.check_run_dir(args.run_dir)
    except status.NotARunDirectory as e:
        print(f"rollhpc status: {e}", file=sys.stderr)
        return 2
    job_id = status.job_id_of(run_dir)
    rescue_id = rescue_jobs(run_dir).get(job_id) if job_id else None
    report = status.build_report(
        run_dir,
        job_id,
        None if job_id is None else status.query_slurm(job_id),
        rescue_id=rescue_id,
        rescue=status.query_slurm(rescue_id) if rescue_id else None,
    )
    print(json.dumps(report, indent=1) if args.json else "\n".join(status.render(report)))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:

    st = sub.add_parser(
        "status",
        help="where a run stands: its Slurm job, step, restarts, checkpoint, and what to do",
        description="Report on a run directory: its Slurm job (each het component's state, nodes and "
        "pending reason, from scontrol, or sacct once scontrol has forgotten it), the last step in "
        "metrics.jsonl against pipeline.options.steps, the restarts in restarts.jsonl, the checkpoint "
        "a resume would use, error.json's summary, and what to do: release a job Slurm holds "
        "(`scontrol release JOBID`), continue one that failed or ran out of restarts "
        "(`slurm/resume.sh RUN_DIR`), or nothing. Read-only; off a Slurm machine it reports the run "
        "directory and says Slurm was not reachable.",
        epilog="Exit status: 0, or 2 when RUN_DIR is not a run directory (no config.yaml).",
    )
    st.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's directory, runs/NAME")
    st.add_argument("--json", action="store_true", help="print the same report as JSON")
    st.set_defaults(func=cmd_status)
