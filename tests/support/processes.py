"""Running the real CLI and probes as processes of their own, and checking that nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def rank_processes(run_dir: Path) -> list[psutil.Process]:
    """Live processes started for this run: every rank has the run directory on its command line, and
    whatever a rank started (a multiprocessing server, an engine's worker) holds its log file open."""
    found, inside = [], str(run_dir) + os.sep
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if str(run_dir) in " ".join(p.info["cmdline"] or []) or any(
                f.path.startswith(inside) for f in p.open_files()
            ):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def assert_no_orphans(run_dir: Path, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while (left := rank_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {[p.info['cmdline'] for p in left]}"


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def rollhpc(*args: str, cwd: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", *args],
        cwd=cwd,
        env=cli_env(),
        text=True,
        capture_output=True,
        timeout=timeout,
        **kw,
    )


def run_probe(script: str, spec: dict, work: Path, timeout: float = 300) -> dict:
    """Run ``tests/support/<script>`` (a probe that needs a process of its own, e.g. vLLM's ``__main__`` guard) on ``spec``
    written as work/spec.json; returns the JSON it wrote to work/result.json, or fails with its output."""
    (work / "spec.json").write_text(json.dumps(spec))
    result = work / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "support" / script),
            str(work / "spec.json"),
            str(result),
        ],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(result.read_text())
