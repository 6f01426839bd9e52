"""The cluster check (configs/cluster_check.yaml, rollhpc.pipelines.cluster_check): its table passes on the local
Slurm at 4 nodes, a wrong placement shows as a failed row, and a config whose model is absent is checked
model-free on the same layout."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from rollhpc.cli.experiment import load_experiment
from rollhpc.pipelines import cluster_check_rows as cc
from rollhpc.pipelines.cluster_check_spec import DIAGNOSTIC_WORKER, split_overrides
from rollhpc.placement.device_mapping import plan_world, weight_sync_routing

# toy_grpo's roles on 4 nodes, 6 ranks: the controller and two reward ranks (het group 0: an intra-node pair), the
# trainers on two nodes (group 1), the generator on the fourth (group 2), one fake GPU a node
LAYOUT = [
    "check.experiment=toy_grpo",
    "cluster.gpus_per_node=1",
    "roles.train.gpus_per_proc=1",
    "roles.generate.gpus_per_proc=1",
    "roles.reward.procs=2",
]


def _probes(plan, hosts: dict[tuple[int, int], str]) -> dict[int, dict]:
    """What each rank would report if it ran exactly as planned."""
    return {
        p.rank: {
            "host": hosts[(p.component, p.node)],
            "cuda": False,
            "device_count": 0,
            "gpu_id": "",
            "cuda_visible_devices": ",".join(str(g) for g in p.gpus) or None,
            "host_cpus": 64,
            "cpus": list(range(plan.components[p.component].cpus_per_task)),
            "rss": 0.0,
        }
        for p in plan.ranks
    }


def test_a_rank_off_its_planned_node_gpus_or_cores_is_a_failed_row():
    cfg = load_experiment("cluster_check", [*LAYOUT, "cluster.nodes=4", "cluster.cpus_per_node=8"])
    plan = plan_world(cfg)
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n2,n3",
        "SLURM_JOB_NODELIST_HET_GROUP_2": "n4",
    }
    expected = cc.expected_hosts(plan, env, None)
    assert expected == {(0, 0): "n1", (1, 0): "n2", (1, 1): "n3", (2, 0): "n4"}
    # without Slurm's het node lists (rollhpc train, even inside an allocation): a world on one host is local
    assert set(cc.expected_hosts(plan, {"SLURM_JOB_ID": "7"}, "laptop").values()) == {"laptop"}
    assert cc.expected_hosts(plan, {}, None) is None
    probed = _probes(plan, expected)
    assert all(r["ok"] for r in cc.rank_rows(plan, probed, expected))
    # the plan says trainer 1 is on its group's second node, but Slurm put it on the first; the generator sees no
    # GPU; het group 0 (the controller and the reward ranks) asked for 4 cores a task and got one
    train1 = plan.ranks_of("train")[1]
    probed[train1]["host"] = "n2"
    gen0 = plan.ranks_of("generate")[0]
    probed[gen0]["cuda_visible_devices"] = None
    rewards = set(plan.ranks_of("reward"))
    doctored = dataclasses.replace(
        plan,
        components=[
            dataclasses.replace(c, cpus_per_task=4) if c.index == 0 else c for c in plan.components
        ],
    )
    rows = {r["rank"]: r for r in cc.rank_rows(doctored, probed, expected)}
    assert rows[train1]["ok"] is False and rows[train1]["why"] == "on n2, planned n3"
    assert rows[gen0]["ok"] is False and "sees 0 GPUs" in rows[gen0]["why"]
    assert all(rows[r]["why"] == "1 CPU cores, planned 4" for r in rewards | {0})
    assert {r for r, row in rows.items() if not row["ok"]} == {0, *rewards, train1, gen0}
    table = cc.render("t", list(rows.values()))
    assert "FAIL: on n2, planned n3" in table
    # without Slurm's node lists only consistency is left: one planned node's ranks on two hosts
    rows = cc.rank_rows(plan, probed, None)
    assert {r["rank"] for r in rows if not r["ok"]} == {plan.ranks_of("train")[0], train1, gen0}


def test_bus_bandwidth_is_nccl_tests_and_judged_against_the_expected_fabric():
    assert cc.bus_gbps("all_reduce", 10**9, 1.0, 4) == (1.0, 1.5)
    assert cc.bus_gbps("broadcast", 10**9, 0.5, 3) == (2.0, 2.0)
    rows = cc.bandwidth_rows(
        "all_reduce inter-node",
        "x",
        "all_reduce",
        [1 << 20, 64 << 20],
        [1e-3, 0.1],
        2,
        "nccl",
        expected_gbps=1.0,
        floor=0.5,
    )
    # 0.67 GB/s (alg = bus at n=2); only the largest size judged
    assert [r["ok"] for r in rows] == [
        None,
        True,
    ]
    rows = cc.bandwidth_rows(
        "x", "x", "all_reduce", [64 << 20], [1.0], 2, "nccl", expected_gbps=10.0, floor=0.5
    )
    assert rows[0]["ok"] is False and "below 0.5 x the expected 10 GB/s" in rows[0]["why"]


def test_a_config_without_its_model_is_checked_model_free_on_its_layout():
    cfg = load_experiment(
        "cluster_check", ["check.experiment=qwen2.5-7b_grpo", "cluster.partition=gpu"]
    )
    real = load_experiment("qwen2.5-7b_grpo", ["cluster.partition=gpu"])
    assert "no model directory" in cfg.pipeline.options.skip_step
    assert {r.worker for r in cfg.roles.values()} == {DIAGNOSTIC_WORKER}
    assert (
        cfg.cluster == dataclasses.replace(real.cluster, time_limit="0:30:00")
        and cfg.run.name == "cluster_check"
    )
    limited = load_experiment(
        "cluster_check", ["check.experiment=qwen2.5-7b_grpo", "cluster.time_limit=2:00:00"]
    )
    assert limited.cluster.time_limit == "2:00:00"  # the command line's limit, not the check's
    # the same ranks on the same nodes and GPUs
    assert plan_world(cfg).ranks == plan_world(real).ranks
    assert split_overrides(
        ["check.iters=2", "run.name=x", "cluster.nodes=2", "+roles.a.procs=1"]
    ) == (["check.iters=2", "run.name=x"], ["cluster.nodes=2", "+roles.a.procs=1"])


# the GPU machine's check: one node, one GPU, the trainer and the torch engine colocated and taking turns
ONE_GPU = [
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "roles.train.gpus_per_proc=1",
    "roles.train.devices=[0]",
    "roles.generate.gpus_per_proc=1",
    "roles.generate.devices=[0]",
    "roles.generate.options.engine=torch",
    "pipeline.options.offload=true",
]


def test_the_check_is_planned_with_the_checked_offload_and_weight_sync():
    cfg = load_experiment("cluster_check", ["check.experiment=quickstart", *ONE_GPU])
    real = load_experiment("quickstart", ONE_GPU)
    checked, own = real.pipeline.options, cfg.pipeline.options
    assert own.skip_step == ""  # quickstart's warm start builds its model: the real roles run
    assert (own.offload, own.weight_sync, own.weight_sync_bucket_mb, own.rollout) == (
        True,
        checked.weight_sync,
        checked.weight_sync_bucket_mb,
        checked.rollout,
    )
    assert weight_sync_routing(cfg, plan_world(cfg)) == weight_sync_routing(real, plan_world(real))
    model_free = load_experiment(
        "cluster_check", ["check.experiment=qwen2.5-7b_grpo", "cluster.partition=gpu"]
    )
    assert model_free.pipeline.options.offload is False  # DiagnosticWorkers hold nothing to offload


def test_gpu_memory_is_one_row_per_gpu_beside_the_plans_start_up_estimate():
    cfg = load_experiment("cluster_check", ["check.experiment=quickstart", *ONE_GPU])
    plan = plan_world(cfg)
    probed = _probes(plan, {(c.index, 0): "gpu1" for c in plan.components})
    # colocated: both see the device's whole use
    for r in plan.ranks_of("train") + plan.ranks_of("generate"):
        probed[r]["gpu_memory"] = [{"index": 0, "used": 3 * 2**30, "total": 80 * 2**30}]
    rows = cc.memory_rows(plan, probed, {(1, 0, 0): 2 * 2**30})
    assert len(rows) == 1 and rows[0]["gpu"] == "gpu1:0" and rows[0]["ok"] is None
    assert (
        rows[0]["planned"] == "2.0 GiB of 80.0 GiB"
        and rows[0]["measured"] == "3.00 GiB in use (above the plan)"
    )
    assert "ranks 2,3" in rows[0]["what"]
    assert cc.memory_rows(plan, probed, {})[0]["planned"] == "not estimated of 80.0 GiB"


@pytest.mark.slurm
def test_cluster_check_passes_on_four_slurm_nodes(slurm_cluster, tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollhpc.cli",
            "submit",
            "cluster_check",
            "--wait",
            f"run.output_dir={tmp_path / 'runs'}",
            *LAYOUT,
            "check.allreduce_mib=[1,4]",
            "check.iters=3",
            "check.weight_sync_mib=8",
            "controller.world_timeout_s=90",
            f"cluster.nodes={slurm_cluster.nodes}",
            f"cluster.cpus_per_node={slurm_cluster.cpus_per_node}",
            "cluster.time_limit=00:10:00",
        ],
        cwd=tmp_path,
        env=slurm_cluster.env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    run_dir = tmp_path / "runs" / "cluster_check"
    outputs = "\n".join(p.read_text() for p in (run_dir / "slurm").glob("job-*.out"))
    assert res.returncode == 0, res.stderr + outputs
    table = json.loads((run_dir / "cluster_check.json").read_text())
    assert table["passed"], table
    ranks = [r for r in table["rows"] if r["check"].startswith("rank ")]
    assert len(ranks) == 6 and all(r["ok"] for r in ranks)
    # 4 simulated nodes, each as planned
    assert len({r["probe"]["host"] for r in ranks}) == slurm_cluster.nodes
    checks = {r["check"] for r in table["rows"]}
    assert {"all_reduce intra-node", "all_reduce inter-node", "weight sync", "rl step"} <= checks
    assert all(r["busbw_gbps"] > 0 for r in table["rows"] if "busbw_gbps" in r)
    assert next(r for r in table["rows"] if r["check"] == "rl step")["ok"] is True
    # the table, on the job's console
    assert "cluster check of toy_grpo: 6 ranks on 4 host(s)" in outputs
    print(outputs[outputs.index("cluster check of") :])
