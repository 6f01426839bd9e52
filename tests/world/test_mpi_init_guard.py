"""The world-formation guard against the signals Slurm sends when it ends a step.

Slurm's SIGTERM reaches every process of a task: the rank and its forked guard alike. The guard must
survive it (and SIGINT, SIGHUP), and a rank that does not act on it (blocked inside C, as in MPI_Init
reading a dead PMI socket) must still end: the guard kills it a short grace later, long before its own
world-formation limit. Real processes, no MPI: the guard does not depend on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.processes import cli_env

RANK = """
import signal, sys, time
from pathlib import Path
from rollhpc.launch.mpi_init_guard import MpiInitGuard
guard = MpiInitGuard(Path(sys.argv[1]), timeout_s=float(sys.argv[2]), role="probe")
if sys.argv[3] == "deaf":  # a rank blocked in C: its signals stay pending
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
print("ready", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def start_rank(tmp_path):
    """Starts a stand-in rank (its own session, like a task under slurmstepd) with its guard; whatever the
    test's outcome, nothing of it outlives the test (a deaf rank would otherwise sleep for an hour)."""
    started = []

    def start(how: str, timeout_s: float = 120) -> tuple[subprocess.Popen, psutil.Process]:
        proc = subprocess.Popen(
            [sys.executable, "-c", RANK, str(tmp_path), str(timeout_s), how],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(proc)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        (guard,) = psutil.Process(proc.pid).children()
        return proc, guard

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_guard_outlives_step_signals_and_kills_a_rank_deaf_to_them(tmp_path, start_rank):
    from rollhpc.launch.mpi_init_guard import SIGNAL_GRACE_S

    signals = ("SIGHUP", "SIGINT", "SIGTERM")  # each would end a guard with default actions

    proc, guard = start_rank("deaf")
    t0 = time.monotonic()
    for name in signals:  # to the whole process group, as Slurm signals every process of a task
        os.killpg(proc.pid, getattr(signal, name))
        time.sleep(0.2)
    time.sleep(1.0)
    assert proc.poll() is None and guard.is_running(), (
        "the rank is deaf; the guard waits out its grace"
    )
    _, err = proc.communicate(timeout=SIGNAL_GRACE_S + 10)
    waited = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL, err
    assert waited < SIGNAL_GRACE_S + 5, f"the rank ended {waited:.1f} s after the first signal"
    assert f"the step was ended ({signals[0]}) while role 'probe', pid {proc.pid}" in err, err
    record = json.loads((tmp_path / "startup-failed.json").read_text())
    assert "still in MPI_Init" in record["why"] and not record["culprit"]
    psutil.wait_procs([guard], timeout=5)
    assert not guard.is_running()


def test_a_rank_that_can_die_of_sigterm_does_and_its_guard_goes_quietly(tmp_path, start_rank):
    proc, guard = start_rank("plain")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGTERM
    psutil.wait_procs([guard], timeout=5)
    assert not guard.is_running() and not (tmp_path / "startup-failed.json").exists()


def test_guard_still_kills_at_its_limit(tmp_path, start_rank):
    proc, _ = start_rank("deaf", timeout_s=2)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and "MPI_Init did not finish within 2 s" in err, err
    assert json.loads((tmp_path / "startup-failed.json").read_text())["culprit"]


MAPPER = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
f.close()  # as MPICH does: the mapping alone keeps the segment in use
print("mapped", flush=True)
time.sleep(600)
"""


def test_a_restart_removes_the_mpi_shared_memory_its_predecessor_left(tmp_path, monkeypatch):
    """A requeued job keeps its job id, so MPICH names its node segments as the killed attempt did; those must
    go before MPI_Init, but never a segment of this attempt (newer) or of a live job (mapped)."""
    from rollhpc.proc import mpi_shm

    def segment(name: str) -> Path:
        path = tmp_path / name
        path.write_bytes(b"\0" * 4096)
        return path

    stale, in_use, other = (
        segment("mpich_shm_9a1b_0"),
        segment("mpich_vci_77_0"),
        segment("other_file"),
    )
    # another world's, a moment old, not mapped yet: never removed
    young = segment("mpich_shm_77aa_0")
    long_ago = time.time() - 2 * mpi_shm.MIN_AGE_S
    for path in (stale, in_use, other):
        os.utime(path, (long_ago, long_ago))
    holder = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(in_use)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "mapped"
        time.sleep(0.05)
        started = time.time()
        time.sleep(0.05)
        fresh = segment("mpich_shm_9a1b_1")  # created by this attempt's first rank
        monkeypatch.setenv(mpi_shm.ATTEMPT_STARTED, f"{started:.6f}")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
        assert mpi_shm.remove_stale_segments(tmp_path) == []  # a first attempt has nothing to clean
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        assert mpi_shm.remove_stale_segments(tmp_path) == [stale.name]
        assert (
            not stale.exists()
            and in_use.exists()
            and fresh.exists()
            and other.exists()
            and young.exists()
        )
    finally:
        holder.kill()
        holder.wait()
