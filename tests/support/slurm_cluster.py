"""pytest plugin: a real, throw-away Slurm cluster on this machine for the tests marked `slurm`.

The session-scoped fixture `slurm_cluster` runs `slurm/local-cluster.sh up` in a fresh directory under /tmp,
on free non-default ports (a developer's cluster on the default ports keeps running), and `down` at the end
of the session, also when tests or the start-up failed. The directory is removed afterwards, except when
some test failed (its logs are then kept; the path is printed). Set ROLLHPC_SLURM_KEEP=1 to always keep it.

The fixture FAILS (never skips) when this machine cannot run the cluster (not root, apt-get or a daemon
failing): CI must really run these tests.

    def test_x(slurm_cluster, tmp_path):
        job = slurm_cluster.sbatch("-o", str(tmp_path / "out"), "--wrap", "echo hi")
        assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollhpc.launch.slurm_cli import TERMINAL

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "local-cluster.sh"

NODES = 4
CPUS_PER_NODE = 8
GPUS_PER_NODE = 4

# variables that would make sbatch/srun/scontrol talk about another cluster's job or change their options
_FOREIGN_ENV = re.compile(r"^(SLURM_|SBATCH_|SRUN_|SALLOC_|SQUEUE_|SINFO_|SCONTROL_)")


@dataclass
class SlurmCluster:
    dir: Path
    # os.environ (less foreign SLURM_*/SBATCH_*/SRUN_* variables) + SLURM_CONF + shim PATH
    env: dict[str, str]
    # how long `local-cluster.sh up` took (includes a first apt-get install)
    up_seconds: float = 0.0
    nodes: int = NODES
    cpus_per_node: int = CPUS_PER_NODE
    # fake GPUs (character devices), enough for CUDA_VISIBLE_DEVICES
    gpus_per_node: int = GPUS_PER_NODE

    def run(
        self, cmd: str | list[str], *, check: bool = True, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """Run a client command (a string goes through bash) against this cluster; text output captured."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        if isinstance(cmd, str):
            cmd = ["bash", "-c", cmd]
        res = subprocess.run(cmd, env=self.env, timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise AssertionError(
                f"{cmd!r} exited {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}"
            )
        return res

    def sbatch(self, *args: str, cwd: str | Path | None = None) -> str:
        """Submit with `sbatch --parsable ARGS`; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def job_records(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job -o ID` as dicts (one per het job component); [] if unknown."""
        res = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        records = []
        for line in res.stdout.splitlines():
            if line.startswith("JobId="):
                records.append(dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line)))
        return records

    def job_state(self, job_id: str) -> str:
        records = self.job_records(job_id)
        if not records:
            raise AssertionError(f"job {job_id} is unknown to slurmctld")
        return records[0]["JobState"]

    def wait_job(self, job_id: str, timeout: float = 60) -> str:
        """Poll `scontrol show job -o` until the job (every het component) is in a terminal state; returns
        the JobState of the job (its het leader). On timeout the job is cancelled and AssertionError raised."""
        deadline = time.monotonic() + timeout
        records: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            records = self.job_records(job_id)
            if records and all(r.get("JobState") in TERMINAL for r in records):
                return records[0]["JobState"]
            time.sleep(0.2)
        self.run(["scancel", str(job_id)], check=False)
        raise AssertionError(
            f"job {job_id} not finished after {timeout}s: "
            f"{[(r.get('JobId'), r.get('JobState'), r.get('Reason')) for r in records]}"
        )


def _ports_free(ports: range) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
    return True


def _pick_ports(nodes: int) -> int:
    """A base port B with B (slurmctld) and B+1..B+nodes (slurmd's) free, away from the defaults."""
    for _ in range(100):
        base = random.randrange(20000, 30000, 16)
        if _ports_free(range(base, base + nodes + 1)):
            return base
    raise RuntimeError("no free port range found for the test Slurm cluster")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest):
    yield from _local_cluster(request, NODES, CPUS_PER_NODE, GPUS_PER_NODE, "task/none")


@pytest.fixture(scope="session")
def slurm_affinity_cluster(request: pytest.FixtureRequest):
    """A second local cluster whose slurmd bind tasks to cores (task/affinity), as real clusters do: its nodes
    declare this machine's real cores (2 on CI), since srun cannot lay tasks out on cores that do not exist."""
    yield from _local_cluster(request, NODES, len(os.sched_getaffinity(0)), 2, "task/affinity")


def _local_cluster(
    request: pytest.FixtureRequest, nodes: int, cpus: int, gpus: int, task_plugin: str
):
    if os.geteuid() != 0:
        pytest.fail(
            "the slurm tests need root: slurm/local-cluster.sh runs munged, slurmctld and slurmd as "
            "root (and may apt-get install slurmctld slurmd slurm-client munge); run pytest as root "
            "or deselect with -m 'not slurm'",
            pytrace=False,
        )
    if shutil.which("bash") is None:
        pytest.fail("the slurm tests need bash", pytrace=False)

    cluster_dir = Path(tempfile.mkdtemp(prefix="rollhpc-slurm-test-", dir="/tmp")).resolve()
    base_env = {k: v for k, v in os.environ.items() if not _FOREIGN_ENV.match(k)}
    port = _pick_ports(nodes)
    up_env = {
        **base_env,
        "SLURM_NODES": str(nodes),
        "SLURM_CPUS_PER_NODE": str(cpus),
        "SLURM_GPUS_PER_NODE": str(gpus),
        "SLURM_CTLD_PORT": str(port),
        "SLURM_SLURMD_PORT_BASE": str(port),
        "SLURM_TASK_PLUGIN": task_plugin,
    }
    env = {
        **base_env,
        "SLURM_CONF": str(cluster_dir / "etc" / "slurm.conf"),
        "PATH": os.pathsep.join([str(cluster_dir / "bin"), base_env.get("PATH", os.defpath)]),
    }
    cluster = SlurmCluster(
        dir=cluster_dir, env=env, nodes=nodes, cpus_per_node=cpus, gpus_per_node=gpus
    )
    failed_before = request.session.testsfailed
    try:
        t0 = time.monotonic()
        try:
            res = subprocess.run(
                ["bash", str(SCRIPT), "up", str(cluster_dir)],
                env=up_env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"slurm/local-cluster.sh up {cluster_dir} did not finish in 600 s; logs: "
                f"{_tail(cluster_dir / 'log' / 'slurmctld.log')}",
                pytrace=False,
            )
        if res.returncode != 0:
            pytest.fail(
                f"could not start the local Slurm cluster (slurm/local-cluster.sh up {cluster_dir} "
                f"exited {res.returncode}); this machine must be able to run Slurm for these tests.\n"
                f"--- stderr\n{res.stderr[-4000:]}\n--- stdout\n{res.stdout[-2000:]}\n"
                f"--- slurmctld.log\n{_tail(cluster_dir / 'log' / 'slurmctld.log')}",
                pytrace=False,
            )
        cluster.up_seconds = time.monotonic() - t0
        yield cluster
    finally:
        res = subprocess.run(
            ["bash", str(SCRIPT), "down", str(cluster_dir)],
            env=up_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        failed = request.session.testsfailed > failed_before
        if res.returncode != 0:
            print(
                f"\nslurm/local-cluster.sh down {cluster_dir} exited {res.returncode}: {res.stderr[-2000:]}"
            )
        if failed or res.returncode != 0 or os.environ.get("ROLLHPC_SLURM_KEEP") == "1":
            print(f"\nlocal Slurm cluster directory kept (logs): {cluster_dir}")
        else:
            shutil.rmtree(cluster_dir, ignore_errors=True)
