"""The batch script of a heterogeneous job, compared with a reviewed golden file."""

from pathlib import Path

from rollhpc.cli import load_experiment
from rollhpc.launch.device_mapping import plan_world
from rollhpc.launch.slurm import render_sbatch
from tests.conftest import rollhpc

GOLDEN = Path(__file__).parent / "golden" / "hetjob.sbatch"
OVERRIDES = ["roles.train.gpus_per_proc=1", "roles.train.procs=8", "roles.train.devices=[0,1,2,3,4,5,6,7]",
             "roles.generate.gpus_per_proc=2", "roles.generate.procs=4", "roles.generate.devices=[0,1,2,3,4,5,6,7]",
             "cluster.nodes=2", "cluster.gpus_per_node=4", "cluster.cpus_per_node=32", "cluster.partition=gpu",
             "cluster.time_limit=02:00:00", "cluster.setup=[module load cuda]", "run.name=golden"]


def render() -> str:
    cfg = load_experiment("quickstart", OVERRIDES)
    return render_sbatch(cfg, plan_world(cfg), Path("/shared/runs/golden"), python="python")


def test_hetjob_batch_script_matches_golden_file():
    text = render()
    if not GOLDEN.exists():
        GOLDEN.write_text(text)
        raise AssertionError(f"golden file written to {GOLDEN}: review it and commit it")
    assert text == GOLDEN.read_text()


def test_submit_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    res = rollhpc("submit", "quickstart", *OVERRIDES, "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("#SBATCH hetjob") == 1 and "--gres=gpu:4" in res.stdout
    assert not (tmp_path / "runs").exists()


def test_submit_refuses_an_impossible_mapping_before_slurm(tmp_path):
    res = rollhpc("submit", "quickstart", *OVERRIDES, "cluster.nodes=1", cwd=tmp_path)
    assert res.returncode == 2 and not (tmp_path / "runs").exists()
    assert "roles.train.devices: GPU ids [4, 5, 6, 7] outside the cluster's 4 GPUs" in res.stderr
