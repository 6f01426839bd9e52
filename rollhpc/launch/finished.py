"""Whether a run has nothing left to do: read from its directory by the batch script's ``start`` (a finished run is
never started again), the rescue job and ``rollhpc status``."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rollhpc.checkpoint.storage import CheckpointStore
from rollhpc.rundir import RunPaths


def finished_run(run_dir: Path) -> str | None:
    """Why the run has nothing left to do, or None: its controller ended cleanly (any attempt), or its
    newest good checkpoint is at the configured last step (``pipeline.options.steps``)."""
    run_dir = Path(run_dir)
    try:
        record = json.loads(RunPaths(run_dir).controller_exit.read_text())
    except (FileNotFoundError, ValueError):
        record = {}
    if record.get("status") == 0:
        return (
            f"its controller ended cleanly (job {record.get('job_id')}, restart "
            f"{record.get('restart', record.get('restart_count'))})"
        )
    steps = configured_steps(run_dir)
    if steps is None:
        return None
    newest = CheckpointStore(RunPaths(run_dir).checkpoints).latest_good(deep=False)
    if newest is not None and newest.step >= steps:
        return f"its newest checkpoint, {newest.path.name}, is its last step (steps={steps})"
    return None


def configured_steps(run_dir: Path) -> int | None:
    """The run's ``pipeline.options.steps`` from RUN_DIR/config.yaml, or None (no such option, no file)."""
    try:
        steps = (yaml.safe_load(RunPaths(run_dir).config.read_text()) or {})["pipeline"]["options"][
            "steps"
        ]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None
