"""`rollhpc submit` against the real local Slurm cluster (slurm/local-cluster.sh, started by the fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from rollhpc.observability.metrics import read_metrics
from rollhpc.placement.device_mapping import WorldPlan

pytestmark = pytest.mark.slurm


def submit(
    slurm_cluster, tmp_path, *overrides: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollhpc.cli",
            "submit",
            "toy_grpo",
            "--wait",
            f"run.output_dir={tmp_path / 'runs'}",
            # a world that fails to form (MPI_Init) is requeued within the test's time
            "controller.world_timeout_s=90",
            *overrides,
        ],
        cwd=tmp_path,
        env=slurm_cluster.env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def test_training_run_through_submit_gets_the_planned_resources(slurm_cluster, tmp_path):
    res = submit(
        slurm_cluster,
        tmp_path,
        "run.name=het",
        "pipeline.options.steps=20",
        "pipeline.options.eval_every=10",
        # train and generate colocated on GPUs 0-1 of one node, a probe role on two GPUs of its own
        "roles.train.gpus_per_proc=1",
        "roles.train.devices=[0,1]",
        "roles.generate.gpus_per_proc=1",
        "roles.generate.procs=2",
        "roles.generate.devices=[0,1]",
        "+roles.probe.worker=rollhpc.workers.diagnostic:DiagnosticWorker",
        "+roles.probe.procs=2",
        "+roles.probe.gpus_per_proc=1",
        f"cluster.nodes={slurm_cluster.nodes}",
        f"cluster.gpus_per_node={slurm_cluster.gpus_per_node}",
        f"cluster.cpus_per_node={slurm_cluster.cpus_per_node}",
        "cluster.time_limit=00:10:00",
    )
    run_dir = tmp_path / "runs" / "het"
    assert res.returncode == 0, res.stderr + "\n".join(
        p.read_text() for p in (run_dir / "slurm").glob("job-*.out")
    )
    assert "completed" in res.stderr.splitlines()[-1]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert metrics[-1]["step"] == 20 and metrics[-1]["policy_version"] == 20

    plan = WorldPlan.load(run_dir / "plan.json")
    world = json.loads((run_dir / "world.json").read_text())
    assert [w["role"] for w in world] == [p.role for p in plan.ranks]  # MPI rank == plan rank
    assert [c.roles for c in plan.components] == [
        ["controller", "reward"],
        ["train", "generate"],
        ["probe"],
    ]
    # ranks the plan puts on one node of one component ran on one Slurm node
    hosts = defaultdict(set)
    for p, w in zip(plan.ranks, world):
        hosts[(p.component, p.node)].add(w["host"])
    assert all(len(h) == 1 for h in hosts.values()), hosts
    # every GPU rank sees exactly its GPUs, taken from Slurm's allocation
    gpu_of = {}
    for p, w in zip(plan.ranks, world):
        if p.gpus:
            ids = w["cuda_visible_devices"].split(",")
            assert len(ids) == len(p.gpus)
            gpu_of[(p.role, p.group_rank)] = (w["host"], ids[0])
        else:
            assert w["cuda_visible_devices"] is None
    # colocated roles share their GPUs; the probe role has GPUs nobody else uses
    assert {gpu_of[("train", g)] for g in range(2)} == {gpu_of[("generate", g)] for g in range(2)}
    assert len({gpu_of[("train", 0)], gpu_of[("train", 1)]}) == 2
    probe = {gpu_of[("probe", g)] for g in range(2)}
    assert len(probe) == 2 and not probe & {gpu_of[("train", g)] for g in range(2)}
    # colocated roles built in turns (controller.startup): the generators only after every trainer rank was ready
    turns = json.loads((run_dir / "startup.json").read_text())["turns"]
    assert [t["roles"] for t in turns] == [["train", "reward", "probe"], ["generate"]]
    trainers_ready = max(turns[0]["ranks"][str(r)][1] for r in plan.ranks_of("train"))
    assert all(turns[1]["ranks"][str(r)][0] >= trainers_ready for r in plan.ranks_of("generate"))
    (job_out,) = (run_dir / "slurm").glob("job-*.out")
    assert (run_dir / "slurm" / "job_id").read_text().strip() in job_out.name


def test_failing_worker_on_slurm_is_reported_and_the_job_ends(slurm_cluster, tmp_path):
    res = submit(
        slurm_cluster,
        tmp_path,
        "run.name=bad",
        "roles.train.options.lr=-1.0",
        f"cluster.nodes={slurm_cluster.nodes}",
        f"cluster.cpus_per_node={slurm_cluster.cpus_per_node}",
    )
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert "raised ValueError in '__init__'" in last and "role 'train'" in last


def test_a_job_sbatch_refuses_exits_2_with_its_reason_and_leaves_no_run_directory(
    slurm_cluster, tmp_path
):
    """An unknown partition: sbatch's own reason in one line, exit 2, and no run directory left behind, so the
    corrected command needs no --overwrite."""
    res = submit(
        slurm_cluster,
        tmp_path,
        "run.name=refused",
        "cluster.partition=nosuchpartition",
        f"cluster.nodes={slurm_cluster.nodes}",
        f"cluster.cpus_per_node={slurm_cluster.cpus_per_node}",
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr  # one line, no traceback
    assert res.stderr.startswith("rollhpc submit: sbatch refused the job: sbatch: error:"), (
        res.stderr
    )
    assert "partition" in res.stderr.lower(), res.stderr
    assert not (tmp_path / "runs" / "refused").exists()


def test_agentic_run_on_slurm_puts_the_env_role_in_the_cpu_component(
    slurm_cluster, tmp_path, tiny_model
):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollhpc.cli",
            "submit",
            "frozenlake",
            "--wait",
            f"run.output_dir={tmp_path / 'runs'}",
            "run.name=agentic",
            f"pipeline.options.model_dir={tiny_model}",
            "pipeline.options.warm_start=null",
            "pipeline.options.steps=2",
            "pipeline.options.groups_per_step=2",
            "pipeline.options.rollout.group_size=2",
            "pipeline.options.rollout.dynamic_sampling=false",
            "pipeline.options.n_heldout=2",
            "pipeline.options.rollout.max_model_len=96",
            "roles.generate.options.max_model_len=96",
            "roles.env.options.env_options.size=3",
            "roles.env.options.env_options.max_turns=6",  # rows fit in 96
            "roles.train.gpus_per_proc=1",
            "roles.env.procs=2",
            "controller.world_timeout_s=90",
            f"cluster.nodes={slurm_cluster.nodes}",
            f"cluster.gpus_per_node={slurm_cluster.gpus_per_node}",
            f"cluster.cpus_per_node={slurm_cluster.cpus_per_node}",
            "cluster.time_limit=00:10:00",
        ],
        cwd=tmp_path,
        env=slurm_cluster.env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    run_dir = tmp_path / "runs" / "agentic"
    assert res.returncode == 0, res.stderr + "\n".join(
        p.read_text() for p in (run_dir / "slurm").glob("job-*.out")
    )
    plan = WorldPlan.load(run_dir / "plan.json")
    assert [c.roles for c in plan.components] == [["controller", "generate", "env"], ["train"]]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert (
        metrics[-1]["step"] == 2
        and metrics[-1]["episodes_started"] >= 4
        and "success_rate" in metrics[-1]
    )
    world = json.loads((run_dir / "world.json").read_text())
    assert sorted(w["role"] for w in world) == ["controller", "env", "env", "generate", "train"]
