"""Building the pieces of an experiment directly: its YAML in a test's directory, one env worker without MPI."""

from __future__ import annotations

from pathlib import Path

import yaml

from rollhpc.parallel import ParallelLayout
from rollhpc.protocol.worker import WorkerContext
from rollhpc.workers.env import EnvWorker


def experiment_writer(tmp_path: Path):
    """``make(data, name)``: write an experiment YAML under tmp_path; returns (yaml_path, run_dir)."""

    def make(data: dict, name: str = "t") -> tuple[Path, Path]:
        data = {
            **data,
            "run": {"name": name, "output_dir": str(tmp_path / "runs"), **data.get("run", {})},
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path, tmp_path / "runs" / name

    return make


def build_env_worker(run_dir: Path, **options):
    """The env role's worker built directly, as one rank of its own (no MPI: its methods are plain calls)."""
    ctx = WorkerContext(
        role="env",
        world_rank=1,
        coords=ParallelLayout(world=1).coords(0),
        group_size=1,
        role_comm=None,
        run_dir=run_dir,
        seed=0,
    )
    return EnvWorker(ctx, EnvWorker.Options(**options))
