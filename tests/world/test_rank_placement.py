"""A rank's placement: GPUs bound before MPI_Init, and a rank not where the plan put it stopping the world.

The world tests start real MPI worlds (the selfcheck experiment: no model) with a ``sitecustomize`` that
records, through an audit hook, the environment at the moment ``mpi4py.MPI`` is imported (MPI_Init).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rollhpc.placement.binding import RankFacts, launcher_rank, placement_problem, planned_host
from rollhpc.placement.device_mapping import Component, RankPlacement, WorldPlan
from rollhpc.placement.hostlist import expand_hostlist
from rollhpc.proc.mpi_fabric import provider_for_mpi_init
from tests.support.processes import cli_env, rollhpc

MPI_INIT_PROBE = """
import json, os, sys
_out = os.environ.get("ROLLHPC_TEST_MPI_INIT_PROBE")
if _out:
    def _hook(event, args):
        if event == "import" and args[0] == "mpi4py.MPI":
            path = os.path.join(_out, f"{os.getpid()}.json")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    json.dump({"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                               "fi_provider": os.environ.get("FI_PROVIDER"), "torch": "torch" in sys.modules}, f)
    sys.addaudithook(_hook)
"""


def test_hostlists_expand_in_slurms_order():
    assert expand_hostlist("node[1-3,7]") == ["node1", "node2", "node3", "node7"]
    assert expand_hostlist("gpu[08-10]x,cpu1") == ["gpu08x", "gpu09x", "gpu10x", "cpu1"]
    assert expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_hostlist("node[1-2")


def test_the_launchers_rank_comes_from_mpi_variables_before_sruns_task_id():
    assert launcher_rank({"SLURM_PROCID": "0", "PMI_RANK": "5"}) == 5  # hydra inside an allocation
    assert launcher_rank({"SLURM_PROCID": "3"}) == 3
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert launcher_rank({}) is None


def _plan() -> WorldPlan:
    ranks = [
        RankPlacement(0, "controller", 0, 0, 0, ()),
        RankPlacement(1, "train", 0, 1, 0, (0,)),
        RankPlacement(2, "train", 1, 1, 1, (0,)),
    ]
    return WorldPlan(
        ranks, [Component(0, ["controller"], 1, 1, 1, 0, 1), Component(1, ["train"], 2, 2, 1, 1, 4)]
    )


def test_placement_problems_name_the_rank_host_gpus_and_cores():
    plan, env = (
        _plan(),
        {"SLURM_JOB_NODELIST_HET_GROUP_0": "cpu1", "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu[3-4]"},
    )
    me = plan.ranks[2]
    assert planned_host(me, plan, env) == "gpu4"
    good = RankFacts("gpu4", "5", 1, (0, 1, 2, 3), True)
    assert placement_problem(me, plan, good, 2, env) is None
    wrong_host = placement_problem(me, plan, RankFacts("gpu3", "5", 1, (0, 1, 2, 3), True), 2, env)
    assert wrong_host.startswith(
        "rank 2 (train 1) runs on gpu3 but the plan puts it on node 1 of het group 1, gpu4"
    )
    assert "sees 2 GPU(s)" in placement_problem(
        me, plan, RankFacts("gpu4", "5,6", 2, (0, 1, 2, 3), True), 2, env
    )
    cores = placement_problem(me, plan, RankFacts("gpu4", "5", 1, (7,), True), 2, env)
    assert "bound to 1 core(s) [7] but the plan gives it 4" in cores
    # not bound: no claim
    assert placement_problem(me, plan, RankFacts("gpu4", "5", 1, (7,), False), 2, env) is None
    assert "announced as rank 1" in placement_problem(me, plan, good, 1, env)
    exclusive = RankFacts("gpu4", "5", 1, (0, 1, 2, 3), True, ("Exclusive_Process",))
    assert "compute mode is Exclusive_Process" in placement_problem(me, plan, exclusive, 2, env)
    # no Slurm
    assert (
        placement_problem(me, plan, RankFacts("anywhere", None, None, (0,), False), None, {})
        is None
    )


def test_only_ranks_whose_gpus_the_plan_shares_ask_for_the_compute_mode():
    from rollhpc.placement.binding import shares_gpus

    plan = _plan()
    assert not shares_gpus(plan.ranks[1], plan)  # the two trainers are on different nodes
    plan.ranks.append(RankPlacement(3, "generate", 0, 1, 1, (0,)))
    assert shares_gpus(plan.ranks[2], plan) and not shares_gpus(plan.ranks[0], plan)


def test_mpis_libfabric_provider_is_set_only_while_mpi_starts():
    env = {"ROLLHPC_MPI_FI_PROVIDER": "tcp"}
    with provider_for_mpi_init(env) as chosen:
        assert chosen == "tcp" and env["FI_PROVIDER"] == "tcp"
    assert "FI_PROVIDER" not in env  # NCCL's OFI plugin, started later, sees the site's environment
    site = {"ROLLHPC_MPI_FI_PROVIDER": "tcp", "FI_PROVIDER": "cxi"}
    with provider_for_mpi_init(site) as chosen:
        assert chosen == "cxi"
    assert site["FI_PROVIDER"] == "cxi"


@pytest.fixture(scope="module")
def selfcheck_run(tmp_path_factory) -> Path:
    """A selfcheck world run through the CLI (its run directory: config, plan, launch command, world.json)."""
    tmp = tmp_path_factory.mktemp("placement")
    res = rollhpc("train", "selfcheck", f"run.output_dir={tmp / 'runs'}", cwd=tmp, timeout=120)
    assert res.returncode == 0, res.stderr
    return tmp / "runs" / "selfcheck"


def test_a_formed_world_records_each_ranks_cores(selfcheck_run):
    world = json.loads((selfcheck_run / "world.json").read_text())
    assert all(w["cpus"] and set(w["cpus"]) <= os.sched_getaffinity(0) for w in world)


def test_gpus_bound_before_mpi_init_and_a_misplaced_world_stops_in_one_line(
    selfcheck_run, tmp_path
):
    plan = json.loads((selfcheck_run / "plan.json").read_text())
    # the probes on the 1st and 2nd allocated GPU
    plan["ranks"][1]["gpus"], plan["ranks"][2]["gpus"] = (
        [0],
        [1],
    )
    (selfcheck_run / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "sitecustomize.py").write_text(MPI_INIT_PROBE)
    (tmp_path / "out").mkdir()
    env = cli_env()
    # as Slurm would say: this job's node is another host
    env.update(
        PYTHONPATH=f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}",
        ROLLHPC_TEST_MPI_INIT_PROBE=str(tmp_path / "out"),
        CUDA_VISIBLE_DEVICES="6,7",
        ROLLHPC_MPI_FI_PROVIDER="tcp",
        SLURM_JOB_NODELIST="node-elsewhere",
    )
    env.pop("FI_PROVIDER", None)
    command = json.loads((selfcheck_run / "launch.json").read_text())["command"]
    res = subprocess.run(command, env=env, text=True, capture_output=True, timeout=120)
    seen = sorted(
        json.loads(p.read_text())["cuda_visible_devices"] for p in (tmp_path / "out").glob("*.json")
    )
    # the controller keeps the allocation's list; each probe had its own GPU when MPI started
    assert seen == ["6", "6,7", "7"], (
        "a rank imported mpi4py.MPI (MPI_Init) before binding its GPUs"
    )
    assert all(
        json.loads(p.read_text())["fi_provider"] == "tcp" for p in (tmp_path / "out").glob("*.json")
    )
    assert res.returncode != 0
    error = json.loads((selfcheck_run / "error.json").read_text())
    assert error["summary"].startswith("placement check: rank 0 (controller 0) runs on ")
    assert "node-elsewhere" in error["summary"] and "\n" not in error["summary"]
    assert len(error["details"].splitlines()) == 3  # every rank named
    exit_record = json.loads((selfcheck_run / "controller-exit.json").read_text())
    assert exit_record["status"] == 1 and exit_record["failure"]["kind"] == "placement"
