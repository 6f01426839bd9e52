"""The batch script of a heterogeneous job, compared with a reviewed golden file."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollhpc.cli import load_experiment
from rollhpc.launch.device_mapping import plan_world
from rollhpc.launch.slurm import render_sbatch
from rollhpc.rank import bind_gpus
from tests.conftest import cli_env, rollhpc

GOLDEN = Path(__file__).parent / "golden" / "hetjob.sbatch"
OVERRIDES = ["roles.train.gpus_per_proc=1", "roles.train.procs=8", "roles.train.devices=[0,1,2,3,4,5,6,7]",
             "roles.generate.gpus_per_proc=2", "roles.generate.procs=4", "roles.generate.devices=[0,1,2,3,4,5,6,7]",
             "cluster.nodes=2", "cluster.gpus_per_node=4", "cluster.cpus_per_node=32", "cluster.partition=gpu",
             "cluster.time_limit=02:00:00", "cluster.setup=[module load cuda]", "run.name=golden"]


def render(*extra: str) -> str:
    cfg = load_experiment("toy_grpo", [*OVERRIDES, *extra])
    return render_sbatch(cfg, plan_world(cfg), Path("/shared/runs/golden"), python="python")


def test_requeue_and_the_time_limit_warning_can_be_turned_off():
    text = render("cluster.requeue=false", "cluster.stop_before_limit_s=0")
    assert "#SBATCH --no-requeue" in text and "--requeue\n" not in text and "--signal" not in text
    assert text.rstrip().endswith("--max-restarts 5 --no-requeue")
    assert "#SBATCH --signal=B:USR1@900" in render("cluster.stop_before_limit_s=900")


def test_mpich_over_pmi2_forms_its_world_with_short_pmi_lines_unless_told_otherwise():
    """Slurm's pmi2 plugin splits a PMI-1 line over 1024 bytes, which UCX's addresses make now and then: the
    world never forms (rollhpc.launch.slurm). OFI unless the environment or cluster.setup chose already."""
    text = render()
    assert text.index('export MPIR_CVAR_CH4_NETMOD="${MPIR_CVAR_CH4_NETMOD:-ofi}"') > text.index("module load cuda")
    assert "MPIR_CVAR_CH4_NETMOD" not in render("cluster.srun_mpi=pmix")


def test_hetjob_batch_script_matches_golden_file():
    text = render()
    if not GOLDEN.exists():
        GOLDEN.write_text(text)
        raise AssertionError(f"golden file written to {GOLDEN}: review it and commit it")
    assert text == GOLDEN.read_text()


def test_submit_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    res = rollhpc("submit", "toy_grpo", *OVERRIDES, "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("#SBATCH hetjob") == 1 and "--gres=gpu:4" in res.stdout
    assert not (tmp_path / "runs").exists()


def test_submit_refuses_an_impossible_mapping_before_slurm(tmp_path):
    res = rollhpc("submit", "toy_grpo", *OVERRIDES, "cluster.nodes=1", cwd=tmp_path)
    assert res.returncode == 2 and not (tmp_path / "runs").exists()
    assert "roles.train.devices: GPU ids [4, 5, 6, 7] outside the cluster's 4 GPUs" in res.stderr


def test_submit_outside_slurm_says_so_before_touching_anything(tmp_path):
    env_path = "/usr/local/nonexistent"  # no sbatch/srun/sacct on this PATH
    res = subprocess.run([sys.executable, "-m", "rollhpc.cli", "submit", "toy_grpo"], cwd=tmp_path, text=True,
                         capture_output=True, env={**cli_env(), "PATH": env_path})
    assert res.returncode == 2
    assert "sbatch, srun, sacct not found: run it on a Slurm login node" in res.stderr
    assert not (tmp_path / "runs").exists()


def test_gpus_come_from_slurms_allocation_not_from_zero(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert bind_gpus((1, 3)) == "5,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(RuntimeError, match="only 2 were allocated"):
        bind_gpus((2,))
    assert bind_gpus(()) is None


@pytest.mark.parametrize("wrapper", ["train.sh", "resume.sh", "convert.sh"])
def test_slurm_wrappers_explain_themselves_and_name_a_missing_environment(tmp_path, wrapper):
    script = Path(__file__).resolve().parent.parent / "slurm" / wrapper
    env = {"PATH": "/usr/bin:/bin", "ROLLHPC_VENV": str(tmp_path / "no-venv")}
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert help_text.returncode == 0 and help_text.stdout.splitlines()[2].strip().startswith(f"slurm/{wrapper} ")
    assert "set -euo" not in help_text.stdout  # the header only, not the code below it
    missing = subprocess.run([str(script), "x", "y", "z"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"slurm/{wrapper}: no rollhpc environment at {tmp_path / 'no-venv'}: run "
                                      f"'make venv' in {script.parent.parent} or set ROLLHPC_VENV")


def test_a_judge_on_gpus_of_its_own_is_a_het_component_of_its_own(tmp_path, tiny_model):
    """A judge role with its own model on its own GPUs: `plan` and `submit --dry-run` show it as its own het
    group (no weight sync goes to it, so nothing ties it to the trainer's or the generator's nodes)."""
    judge = ["+roles.judge.worker=rollhpc.workers.judge:JudgeWorker", "+roles.judge.procs=2",
             "+roles.judge.gpus_per_proc=2", "+roles.judge.devices=[8,9,10,11]",
             f"+roles.judge.options.policy_model_dir={tiny_model}", f"+roles.judge.options.judge_model_dir={tiny_model}"]
    args = ["toy_grpo", *OVERRIDES, "cluster.nodes=3", *judge]
    plan = rollhpc("plan", *args, cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "judge" in plan.stdout
    res = rollhpc("submit", *args, "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    groups = re.findall(r"^# het group (\d+): (.+)$", res.stdout, flags=re.M)
    assert [roles for _, roles in groups if "judge" in roles] == ["judge"], groups
    assert res.stdout.count("#SBATCH hetjob") == len(groups) - 1 >= 2
    missing = rollhpc("plan", *args[:-1], "+roles.judge.options.judge_model_dir=/nonexistent/judge", cwd=tmp_path)
    assert missing.returncode == 2 and "judge_model_dir" in missing.stderr and "/nonexistent/judge" in missing.stderr
