"""srun places every rank and its cores as the plan says, on a local Slurm whose slurmd bind tasks to cores.

One selfcheck world (no model) in three het groups: the controller; three 1-GPU probes on two nodes, two and
one (an uneven last node, which srun's block distribution would rebalance); one probe with two cores. Every rank
checks its own host, GPUs and cores at start-up (rollhpc.placement.binding): the run finishing says they held;
world.json's core sets say how srun bound them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from rollhpc.placement.device_mapping import WorldPlan
from rollhpc.rundir import RunPaths

pytestmark = pytest.mark.slurm


def test_each_rank_runs_on_its_planned_node_and_cores_even_when_uneven(
    slurm_affinity_cluster, tmp_path
):
    cluster = slurm_affinity_cluster
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollhpc.cli",
            "submit",
            "selfcheck",
            "--wait",
            f"run.output_dir={tmp_path / 'runs'}",
            "run.name=placed",
            "roles.probe.procs=3",
            "+roles.probe.gpus_per_proc=1",
            "+roles.wide.worker=rollhpc.workers.diagnostic:DiagnosticWorker",
            "+roles.wide.procs=1",
            "+roles.wide.gpus_per_proc=1",
            "+roles.wide.cpus_per_proc=2",
            f"cluster.nodes={cluster.nodes}",
            f"cluster.gpus_per_node={cluster.gpus_per_node}",
            f"cluster.cpus_per_node={cluster.cpus_per_node}",
            "cluster.time_limit=00:10:00",
            "cluster.requeue=false",
            "controller.world_timeout_s=90",
        ],
        cwd=tmp_path,
        env=cluster.env,
        text=True,
        capture_output=True,
        timeout=240,
    )
    run_dir = tmp_path / "runs" / "placed"
    logs = "\n".join(p.read_text() for p in (run_dir / "slurm").glob("job-*.out"))
    assert res.returncode == 0, res.stderr + logs
    plan = WorldPlan.load(run_dir / "plan.json")
    assert [(c.roles, c.nodes, c.ntasks, c.cpus_per_task) for c in plan.components] == [
        (["controller"], 1, 1, 1),
        (["probe"], 2, 3, 1),
        (["wide"], 1, 1, 2),
    ]
    script = RunPaths(run_dir).batch_script.read_text()
    assert (
        '--het-group=1 --mpi=pmi2 --nodes=2 --ntasks=3 --distribution=arbitrary --nodelist="$hosts_1"'
        in script
    )
    world = json.loads((run_dir / "world.json").read_text())
    cores_on = defaultdict(list)
    hosts = defaultdict(set)
    for p, w in zip(plan.ranks, world):
        # bound to its own cores
        assert len(w["cpus"]) == plan.components[p.component].cpus_per_task, (
            p,
            w,
        )
        cores_on[w["host"]].append(set(w["cpus"]))
        hosts[(p.component, p.node)].add(w["host"])
    assert all(len(h) == 1 for h in hosts.values()), hosts
    probe_hosts = [w["host"] for p, w in zip(plan.ranks, world) if p.role == "probe"]
    assert sorted(probe_hosts.count(h) for h in set(probe_hosts)) == [1, 2]  # 2 + 1, not rebalanced
    for host, sets in cores_on.items():  # ranks of one node never share a core
        assert sum(len(s) for s in sets) == len(set().union(*sets)), (host, sets)
