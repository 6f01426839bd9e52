"""The local Slurm cluster (slurm/local-cluster.sh) does what the project relies on: batch jobs, heterogeneous
jobs with fake GPUs, one MPI world across het groups (mpi4py + mpich wheel, srun --mpi=pmi2), requeue."""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

# sys.executable: the tests run with the project's .venv python, which has mpi4py + the mpich wheel
PY = sys.executable
RANK_CODE = (
    "import sys; from mpi4py import MPI; c = MPI.COMM_WORLD; "
    "print(f'rank {c.Get_rank()}/{c.Get_size()} {sys.argv[1]}', flush=True)"
)


def wait_for_text(path: Path, pattern: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text, re.M):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout}s: {text!r}")


def het_script(tmp_path: Path, body: str) -> Path:
    """Two components: 0 = one task with one CPU; 1 = one node, two tasks, two (fake) GPUs."""
    script = tmp_path / "het.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -o {tmp_path}/het.out
#SBATCH -n1 -c1
#SBATCH hetjob
#SBATCH -N1 -n2 --gres=gpu:2
set -e
{body}
""")
    return script


def test_sbatch_wrap_completes(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    job = slurm_cluster.sbatch(
        "-o", str(out), "--wrap", "echo hello-from-slurm on $SLURMD_NODENAME"
    )
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"
    assert re.fullmatch(r"hello-from-slurm on node\d+\n", out.read_text())
    # the scontrol-backed sacct shim is first on PATH and knows the job
    sacct = slurm_cluster.run(
        ["sacct", "-j", job, "-o", "JobID,State", "--parsable2", "--noheader"]
    )
    assert sacct.stdout.strip() == f"{job}|COMPLETED"


def test_het_job_gpu_group_sees_two_gpus(slurm_cluster, tmp_path):
    script = het_script(tmp_path, "srun --het-group=1 bash -c 'echo gpus=$CUDA_VISIBLE_DEVICES'")
    job = slurm_cluster.sbatch(str(script), cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED", (
        tmp_path / "het.out"
    ).read_text()
    lines = (tmp_path / "het.out").read_text().split()
    assert len(lines) == 2, lines  # the two tasks of component 1
    for line in lines:
        ids = line.removeprefix("gpus=").split(",")
        assert len(ids) == 2 and len(set(ids)) == 2 and all(i.isdigit() for i in ids), line


def test_mpmd_mpi_world_across_het_groups(slurm_cluster, tmp_path):
    code = shlex.quote(RANK_CODE)
    py = shlex.quote(PY)
    script = het_script(
        tmp_path,
        f"srun --mpi=pmi2 --het-group=0 -n1 {py} -c {code} g0 "
        f": --het-group=1 -n2 {py} -c {code} g1",
    )
    job = slurm_cluster.sbatch(str(script), cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED", (
        tmp_path / "het.out"
    ).read_text()
    ranks = sorted(
        re.findall(r"^rank (\d+)/(\d+) (g\d)$", (tmp_path / "het.out").read_text(), re.M)
    )
    assert ranks == [("0", "3", "g0"), ("1", "3", "g1"), ("2", "3", "g1")], (
        tmp_path / "het.out"
    ).read_text()


def test_requeue_increments_restart_count(slurm_cluster, tmp_path):
    out = tmp_path / "rq.out"
    job = slurm_cluster.sbatch(
        "--requeue",
        "--open-mode=append",
        "-o",
        str(out),
        "--wrap",
        "echo run ${SLURM_RESTART_COUNT:-0}; sleep 120",
    )
    try:
        wait_for_text(out, r"^run 0$", timeout=30)
        slurm_cluster.run(["scontrol", "requeue", job])
        text = wait_for_text(out, r"^run 1$", timeout=40)  # ~6 s: cred_expire=5 delays the restart
        assert text.startswith("run 0\n"), text
        assert slurm_cluster.job_records(job)[0]["Restarts"] == "1"
    finally:
        slurm_cluster.run(["scancel", job], check=False)
    assert slurm_cluster.wait_job(job, timeout=30) == "CANCELLED"
