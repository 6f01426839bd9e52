"""The batch script of a heterogeneous job, compared with a reviewed golden file."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rollhpc.cli.experiment import load_experiment
from rollhpc.config import ConfigError
from rollhpc.config.container import ContainerConfig
from rollhpc.launch.slurm import container_mounts, render_rescue, render_sbatch
from rollhpc.placement.device_mapping import plan_world
from rollhpc.placement.binding import bind_gpus
from tests.support.processes import cli_env, rollhpc

GOLDEN = Path(__file__).parents[1] / "support" / "golden" / "hetjob.sbatch"
OVERRIDES = [
    "roles.train.gpus_per_proc=1",
    "roles.train.procs=8",
    "roles.train.devices=[0,1,2,3,4,5,6,7]",
    "roles.generate.gpus_per_proc=2",
    "roles.generate.procs=4",
    "roles.generate.devices=[0,1,2,3,4,5,6,7]",
    "cluster.nodes=2",
    "cluster.gpus_per_node=4",
    "cluster.cpus_per_node=32",
    "cluster.partition=gpu",
    "cluster.time_limit=02:00:00",
    "cluster.setup=[module load cuda]",
    "run.name=golden",
]


def render(*extra: str) -> str:
    cfg = load_experiment("toy_grpo", [*OVERRIDES, *extra])
    return render_sbatch(cfg, plan_world(cfg), Path("/shared/runs/golden"), python="python")


def test_requeue_and_the_time_limit_warning_can_be_turned_off():
    text = render("cluster.requeue=false", "cluster.stop_before_limit_s=0")
    assert "#SBATCH --no-requeue" in text and "--requeue\n" not in text and "--signal" not in text
    assert text.rstrip().endswith("--max-restarts 5 --no-requeue")
    assert "#SBATCH --signal=B:USR1@900" in render("cluster.stop_before_limit_s=900")


def test_mpich_over_pmi2_forms_its_world_with_short_pmi_lines_by_default():
    """Slurm's pmi2 plugin splits a PMI-1 line over 1024 bytes, which UCX's addresses make now and then: the
    world never forms (rollhpc.launch.slurm). OFI unless the environment or cluster.setup chose already."""
    text = render()
    assert text.index('export MPIR_CVAR_CH4_NETMOD="${MPIR_CVAR_CH4_NETMOD:-ofi}"') > text.index(
        "module load cuda"
    )
    assert "MPIR_CVAR_CH4_NETMOD" not in render("cluster.srun_mpi=pmix")


def test_rescue_job_script_matches_golden_file():
    """The rescue job (rollhpc.launch.rescue): one task for minutes, never requeued, its own partition when one is
    named, the cluster's setup lines, the run's restart bound; the job it waits for comes as its argument."""
    cfg = load_experiment(
        "toy_grpo", [*OVERRIDES, "cluster.rescue_partition=cpu", "cluster.max_restarts=7"]
    )
    text = render_rescue(cfg, Path("/shared/runs/golden"), python="python")
    golden = GOLDEN.with_name("rescue.sbatch")
    if not golden.exists():
        golden.write_text(text)
        raise AssertionError(f"golden file written to {golden}: review it and commit it")
    assert text == golden.read_text()
    assert "#SBATCH --partition=gpu" in render_rescue(
        load_experiment("toy_grpo", OVERRIDES), Path("/r"), "python"
    )


def test_hetjob_batch_script_matches_golden_file():
    text = render()
    if not GOLDEN.exists():
        GOLDEN.write_text(text)
        raise AssertionError(f"golden file written to {GOLDEN}: review it and commit it")
    assert text == GOLDEN.read_text()


def test_shipped_7b_config_puts_the_controller_on_a_cpu_partition():
    """Issue 34: qwen2.5-7b_grpo's het group 0 (controller + 8 reward ranks) asks for a CPU partition with its own
    memory and no --exclusive; the GPU group keeps its partition, memory and whole nodes (no two groups of the
    job can then share a node). Two GPU nodes in all, not three."""
    cfg = load_experiment("qwen2.5-7b_grpo", [])
    text = render_sbatch(
        cfg, plan_world(cfg), Path("/shared/runs/qwen2.5-7b-grpo"), python="python"
    )
    golden = GOLDEN.with_name("qwen2.5-7b_grpo.sbatch")
    if not golden.exists():
        golden.write_text(text)
        raise AssertionError(f"golden file written to {golden}: review it and commit it")
    assert text == golden.read_text()
    groups = text.split("#SBATCH hetjob")
    assert len(groups) == 2
    assert (
        "--partition=cpu" in groups[0]
        and "--mem=64G" in groups[0]
        and "--exclusive" not in groups[0]
    )
    assert "--gres" not in groups[0]
    assert all(
        opt in groups[1] for opt in ("--nodes=2", "--partition=gpu", "--mem=800G", "--exclusive")
    )
    # left to the cluster's values where the CPU component names none; asked for, it holds its nodes alone
    shared = render("cluster.account=proj1", "cluster.mem_per_node=500G").split("#SBATCH hetjob")[0]
    assert "--partition=gpu" in shared and "--account=proj1" in shared and "--mem" not in shared
    own = render("+cluster.cpu_component.exclusive=true", "+cluster.cpu_component.qos=cpu_q").split(
        "#SBATCH hetjob"
    )
    assert "--exclusive" in own[0] and "--qos=cpu_q" in own[0] and "--qos" not in own[1]


# the reviewed container variants of the golden job: the same world, its ranks in an image
CONTAINERS = {
    # a .sif on the shared filesystem, models read-only; the run dir (not under a mount) is bound by itself
    "apptainer": [
        "cluster.container.kind=apptainer",
        "cluster.container.image=/shared/images/rollhpc.sif",
        "cluster.container.mounts=[/shared/models:/shared/models:ro]",
        "cluster.container.extra=[--writable-tmpfs]",
    ],
    # a squashfs image, PMIx, a host interpreter of its own for the batch-side helpers; /shared/runs (short
    # form) shows the run dir already, so it gets no mount of its own
    "pyxis": [
        "cluster.container.kind=pyxis",
        "cluster.container.image=/shared/images/rollhpc.sqsh",
        "cluster.container.mounts=[/shared/runs,/shared/models:/models:ro]",
        "cluster.container.extra=[--no-container-mount-home]",
        "cluster.container.batch_python=/shared/envs/rollhpc-host/bin/python",
        "cluster.srun_mpi=pmix",
    ],
}


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_container_batch_script_matches_golden_file(kind):
    golden = GOLDEN.with_name(f"hetjob_{kind}.sbatch")
    text = render(*CONTAINERS[kind])
    if not golden.exists():
        golden.write_text(text)
        raise AssertionError(f"golden file written to {golden}: review it and commit it")
    assert text == golden.read_text()


def test_no_container_leaves_the_batch_script_as_it_was():
    assert render("cluster.container.kind=none") == GOLDEN.read_text()


def rank_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "rollhpc.rank" in line]


def test_apptainer_wraps_every_rank_and_leaves_the_batch_side_on_the_host():
    """Every rank runs in the image (--nv only where its group has GPUs); the requeue helpers and the no-op steps
    run on the host, which has Slurm's commands, with the submitting interpreter or cluster.container.batch_python."""
    text = render(*CONTAINERS["apptainer"])
    ranks = rank_lines(text)
    assert len(ranks) == 2 and all(
        " /shared/images/rollhpc.sif python3 -m rollhpc.rank /shared/runs/golden" in line
        for line in ranks
    )
    assert "--export=ALL,OMP_NUM_THREADS=1 apptainer exec --bind " in ranks[0]
    assert "--export=ALL,OMP_NUM_THREADS=1 apptainer exec --nv --bind " in ranks[1]
    helpers = [
        line
        for line in text.splitlines()
        if "rollhpc.launch.requeue" in line and not line.startswith("#")
    ]
    assert len(helpers) == 3 and not any("apptainer" in line for line in helpers)
    assert all(
        line.startswith(("started=$(python -m", "python -m", "exec python -m")) for line in helpers
    )
    assert "srun --het-group=0 --nodes=1 --ntasks=1 true; done" in text
    # pmi2: MPICH inside, as outside
    assert 'export MPIR_CVAR_CH4_NETMOD="${MPIR_CVAR_CH4_NETMOD:-ofi}"' in text
    own = render(*CONTAINERS["apptainer"], "cluster.container.batch_python=/opt/host/bin/python3")
    assert rank_lines(own) == ranks
    assert own.count("/opt/host/bin/python3 -m rollhpc.launch.requeue") == 3


def test_pyxis_gives_every_het_group_the_same_container_options():
    """pyxis's options are SPANK options, held once per srun step: every segment carries the same ones, and the
    command goes through /usr/bin/env so that the image's PATH, not the host's, finds the interpreter."""
    text = render(*CONTAINERS["pyxis"])
    ranks = rank_lines(text)
    wrapped = [line[line.index("--container-image=") :].rstrip(" \\&") for line in ranks]
    assert len(wrapped) == 2 and wrapped[0] == wrapped[1] == (
        "--container-image=/shared/images/rollhpc.sqsh --container-mounts=/shared/runs:/shared/runs,"
        "/shared/models:/models:ro --no-container-mount-home /usr/bin/env python3 -m rollhpc.rank /shared/runs/golden"
    )
    assert "--mpi=pmix" in ranks[0] and "MPIR_CVAR_CH4_NETMOD" not in text and "--nv" not in text
    registry = render(
        *CONTAINERS["pyxis"], "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'"
    )
    words = shlex.split(rank_lines(registry)[0].rstrip(" \\"))  # what bash hands srun
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in words


@pytest.mark.parametrize(
    "mounts, kind, expected",
    [
        (["/shared"], "apptainer", ["/shared"]),  # shows the run dir at its own path
        (
            ["/shared:/shared:ro"],
            "apptainer",
            ["/shared:/shared:ro", "/shared/runs/x"],
        ),  # read-only: bound again
        (
            ["/shared:/data"],
            "apptainer",
            ["/shared:/data", "/shared/runs/x"],
        ),  # elsewhere inside: bound again
        (
            ["/shared/run"],
            "apptainer",
            ["/shared/run", "/shared/runs/x"],
        ),  # a sibling, not a parent
        ([], "pyxis", ["/shared/runs/x:/shared/runs/x"]),
        (
            ["/shared/runs/x/", "/m:/m:ro+rprivate"],
            "pyxis",
            ["/shared/runs/x/:/shared/runs/x/", "/m:/m:ro+rprivate"],
        ),
    ],
)
def test_the_run_dir_is_mounted_at_its_path_unless_a_writable_mount_has_it(mounts, kind, expected):
    image = "/i.sif" if kind == "apptainer" else "/i.sqsh"
    container = ContainerConfig(kind=kind, image=image, mounts=mounts)
    assert container_mounts(container, Path("/shared/runs/x")) == expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["kind=docker"],
            r"cluster\.container\.kind: 'docker' is not one of \['none', 'apptainer', 'pyxis'\]",
        ),
        (
            ["image=/i.sif"],
            r"^cluster\.container\.image: set, but cluster\.container\.kind is 'none'",
        ),
        (["kind=apptainer"], r"^cluster\.container\.image: empty: kind apptainer needs the image"),
        (
            ["kind=pyxis", "image=''"],
            r"^cluster\.container\.image: empty: kind pyxis needs the image",
        ),
        (
            ["kind=apptainer", "image=docker://ubuntu:24.04"],
            r"^cluster\.container\.image: .*build it once",
        ),
        (
            ["kind=apptainer", "image=images/i.sif"],
            r"^cluster\.container\.image: 'images/i.sif' is relative",
        ),
        (
            ["kind=pyxis", "image=/i.sif"],
            r"^cluster\.container\.image: '/i.sif' is an Apptainer image",
        ),
        (
            ["kind=pyxis", "image=i.sqsh"],
            r"^cluster\.container\.image: 'i.sqsh': pyxis reads a name that does not",
        ),
        (
            ["kind=apptainer", "image=/i.sif", "mounts=[/a:/b:ro:x]"],
            r"^cluster\.container\.mounts\[0\]: '/a:/b:ro:x' is not 'src\[:dst\[:opts\]\]'",
        ),
        (
            ["kind=apptainer", "image=/i.sif", "mounts=[/a::ro]"],
            r"^cluster\.container\.mounts\[0\]: '/a::ro' is not",
        ),
        (
            ["kind=pyxis", "image=/i.sqsh", "mounts=[/ok,data:/data]"],
            r"^cluster\.container\.mounts\[1\]: 'data:/data': source and destination must be absolute",
        ),
        (
            ["kind=apptainer", "image=/i.sif", "mounts=[/a:/a:ro+rprivate]"],
            r"apptainer's bind options are ro or rw",
        ),
        (
            ["kind=pyxis", "image=/i.sqsh", "mounts=[/a:/a:ro+]"],
            r"pyxis's mount flags are joined with '\+'",
        ),
        (
            ["kind=apptainer", "image=/i.sif", "extra=[--cleanenv]"],
            r"^cluster\.container\.extra\[0\]: '--cleanenv' clears the environment inside the container: srun's PMI_",
        ),
        (["kind=apptainer", "image=/i.sif", "extra=[-C]"], r"'-C' clears the environment"),
        (
            ["kind=apptainer", "image=/i.sif", "extra=[writable-tmpfs]"],
            r"one option per item, written --flag",
        ),
        (
            ["kind=pyxis", "image=/i.sqsh", "extra=[--nv]"],
            r"pyxis's options are srun's --container-\* and",
        ),
        (
            ["kind=pyxis", "image=/i.sqsh", "extra=['--container-image=/j.sqsh']"],
            r"set it with cluster\.container\.image",
        ),
        (["kind=apptainer", "image=/i.sif", "python=''"], r"^cluster\.container\.python: empty"),
        (
            ["kind=pyxis", "image=/i.sqsh", "batch_python=.venv/bin/python"],
            r"^cluster\.container\.batch_python: '\.venv/bin/python' is not one interpreter",
        ),
    ],
)
def test_container_mistakes_fail_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment("toy_grpo", [*OVERRIDES, *(f"cluster.container.{o}" for o in overrides)])


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_submit_dry_run_shows_the_ranks_in_their_container(tmp_path, kind):
    res = rollhpc("submit", "toy_grpo", *OVERRIDES, *CONTAINERS[kind], "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    # outside every configured mount: mounted by itself
    run = tmp_path.resolve() / "runs" / "golden"
    wrapped = {
        "apptainer": f"apptainer exec --nv --bind /shared/models:/shared/models:ro,{run} --writable-tmpfs "
        f"/shared/images/rollhpc.sif python3 -m rollhpc.rank {run}",
        "pyxis": f"--container-image=/shared/images/rollhpc.sqsh --container-mounts=/shared/runs:/shared/runs,"
        f"/shared/models:/models:ro,{run}:{run} --no-container-mount-home "
        f"/usr/bin/env python3 -m rollhpc.rank {run}",
    }[kind]
    ranks = rank_lines(res.stdout)  # het group 0 (controller, reward) has no GPUs: no --nv there
    assert len(ranks) == 2 and wrapped in ranks[1] and wrapped.replace(" --nv", "") in ranks[0]
    assert not (tmp_path / "runs").exists()


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
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "submit", "toy_grpo"],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        env={**cli_env(), "PATH": env_path},
    )
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
    script = Path(__file__).resolve().parents[2] / "slurm" / wrapper
    env = {"PATH": "/usr/bin:/bin", "ROLLHPC_VENV": str(tmp_path / "no-venv")}
    help_text = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert help_text.returncode == 0 and help_text.stdout.splitlines()[2].strip().startswith(
        f"slurm/{wrapper} "
    )
    assert "set -euo" not in help_text.stdout  # the header only, not the code below it
    missing = subprocess.run(
        [str(script), "x", "y", "z"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        f"slurm/{wrapper}: no rollhpc environment at {tmp_path / 'no-venv'}: run "
        f"'make venv' in {script.parent.parent} or set ROLLHPC_VENV"
    )


def test_a_judge_on_gpus_of_its_own_is_a_het_component_of_its_own(tmp_path, tiny_model):
    """A judge role with its own model on its own GPUs: `plan` and `submit --dry-run` show it as its own het
    group (no weight sync goes to it, so nothing ties it to the trainer's or the generator's nodes)."""
    judge = [
        "+roles.judge.worker=rollhpc.workers.judge:JudgeWorker",
        "+roles.judge.procs=2",
        "+roles.judge.gpus_per_proc=2",
        "+roles.judge.devices=[8,9,10,11]",
        "+roles.judge.options.tensor_parallel_size=2",  # its engine spreads over its rank's 2 GPUs
        f"+roles.judge.options.policy_model_dir={tiny_model}",
        f"+roles.judge.options.judge_model_dir={tiny_model}",
    ]
    args = ["toy_grpo", *OVERRIDES, "cluster.nodes=3", *judge]
    plan = rollhpc("plan", *args, cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "judge" in plan.stdout
    res = rollhpc("submit", *args, "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    groups = re.findall(r"^# het group (\d+): (.+)$", res.stdout, flags=re.M)
    assert [roles for _, roles in groups if "judge" in roles] == ["judge"], groups
    assert res.stdout.count("#SBATCH hetjob") == len(groups) - 1 >= 2
    missing = rollhpc(
        "plan", *args[:-1], "+roles.judge.options.judge_model_dir=/nonexistent/judge", cwd=tmp_path
    )
    assert (
        missing.returncode == 2
        and "judge_model_dir" in missing.stderr
        and "/nonexistent/judge" in missing.stderr
    )


def test_each_srun_segment_carries_its_own_nodes_tasks_cores_and_gpus():
    """Issue 54: no segment leans on srun's defaults (sbatch's --cpus-per-task is not passed on to srun in Slurm
    22.05-23.02; in a het job the plain SLURM_CPUS_PER_TASK is group 0's). The uneven last node's host list:
    tests/world/test_slurm_placement.py."""
    text = render(
        "roles.train.cpus_per_proc=4", "cluster.cpu_bind=threads", "cluster.network_interface=ib0"
    )
    srun = text[text.index("srun --kill-on-bad-exit") :]
    assert (
        "--het-group=0 --mpi=pmi2 --nodes=1 --ntasks=2 --ntasks-per-node=2 --distribution=block "
        "--cpus-per-task=1 --cpu-bind=threads" in srun
    )
    assert (
        "--cpus-per-task=4 --cpu-bind=threads --gres=gpu:4 --gpu-bind=none --export=ALL,OMP_NUM_THREADS=4"
        in srun
    )
    assert (
        "export ROLLHPC_DIST_IFNAME=ib0" in text
        and 'export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-ib0}"' in text
    )
    # NCCL's OFI plugin keeps the site's
    assert "FI_PROVIDER=" not in text.replace("ROLLHPC_MPI_FI_PROVIDER=", "")
    with pytest.raises(ConfigError, match="cluster.cpu_bind"):
        render("cluster.cpu_bind=rank")
    with pytest.raises(ConfigError, match="cluster.network_interface"):
        render("cluster.network_interface=ib0; rm")


def test_rendezvous_address_is_each_nodes_own_on_the_named_interface():
    from rollhpc.transport.rendezvous import rendezvous_host

    assert rendezvous_host({"ROLLHPC_DIST_IFNAME": "lo"}) == "127.0.0.1"
    assert rendezvous_host({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert (
        rendezvous_host({"ROLLHPC_DIST_HOST": "10.0.0.7", "ROLLHPC_DIST_IFNAME": "lo"})
        == "10.0.0.7"
    )
    with pytest.raises(RuntimeError, match="'nosuch0'"):
        rendezvous_host({"ROLLHPC_DIST_IFNAME": "nosuch0"})
