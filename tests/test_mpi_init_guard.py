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

from tests.conftest import cli_env

RANK = """
import signal, sys, time
from pathlib import Path
from rollhpc.mpi_init_guard import MpiInitGuard
guard = MpiInitGuard(Path(sys.argv[1]), timeout_s=float(sys.argv[2]), role="probe")
if sys.argv[3] == "deaf":  # a rank blocked in C: its signals stay pending
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
print("ready", flush=True)
time.sleep(3600)
"""


def start_rank(tmp_path: Path, how: str, timeout_s: float = 120) -> tuple[subprocess.Popen, psutil.Process]:
    """A stand-in rank (its own session, like a task under slurmstepd) and its guard, both running."""
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), str(timeout_s), how], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    (guard,) = psutil.Process(proc.pid).children()
    return proc, guard


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGHUP", "SIGINT", "SIGTERM")])
def test_guard_outlives_step_signals_and_kills_a_rank_deaf_to_them(tmp_path, signals):
    from rollhpc.mpi_init_guard import SIGNAL_GRACE_S

    proc, guard = start_rank(tmp_path, "deaf")
    t0 = time.monotonic()
    for name in signals:  # to the whole process group, as Slurm signals every process of a task
        os.killpg(proc.pid, getattr(signal, name))
        time.sleep(0.2)
    time.sleep(1.0)
    assert proc.poll() is None and guard.is_running(), "the rank is deaf; the guard waits out its grace"
    _, err = proc.communicate(timeout=SIGNAL_GRACE_S + 10)
    waited = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL, err
    assert waited < SIGNAL_GRACE_S + 5, f"the rank ended {waited:.1f} s after the first signal"
    assert f"the step was ended ({signals[0]}) while role 'probe', pid {proc.pid}" in err, err
    record = json.loads((tmp_path / "startup-failed.json").read_text())
    assert "still in MPI_Init" in record["why"] and not record["culprit"]
    psutil.wait_procs([guard], timeout=5)
    assert not guard.is_running()


def test_a_rank_that_can_die_of_sigterm_does_and_its_guard_goes_quietly(tmp_path):
    proc, guard = start_rank(tmp_path, "plain")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGTERM
    psutil.wait_procs([guard], timeout=5)
    assert not guard.is_running() and not (tmp_path / "startup-failed.json").exists()


def test_guard_still_kills_at_its_limit(tmp_path):
    proc, _ = start_rank(tmp_path, "deaf", timeout_s=2)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and "MPI_Init did not finish within 2 s" in err, err
    assert json.loads((tmp_path / "startup-failed.json").read_text())["culprit"]
