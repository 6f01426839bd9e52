"""Processes that libraries fork under a rank die with it (megatron's checkpoint writer forks one process per
write bucket; a rank SIGKILLed mid-write left it behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FORKER = """
import os, sys, time
from rollhpc.proc.parent_death import forked_children_die_with_us
if sys.argv[1] == "covered":
    forked_children_die_with_us()
child = os.fork()
if child == 0:
    grandchild = os.fork()  # a helper's own helper: covered too
    if grandchild == 0:
        time.sleep(60)
        os._exit(0)
    os.write(1, f"{grandchild}\\n".encode())  # one write a line: the two processes' lines must not interleave
    time.sleep(60)
    os._exit(0)
os.write(1, f"{child}\\n".encode())
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # a zombie has died (nobody reaped it yet)
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _forked_after_sigkill(mode: str) -> list[bool]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKER, mode], stdout=subprocess.PIPE, text=True, env=env
    )
    pids = [int(proc.stdout.readline()), int(proc.stdout.readline())]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the parent-death signal's victims may take a moment on a busy machine
    deadline = time.monotonic() + 3.0
    while any(alive := [_alive(p) for p in pids]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def test_forked_children_and_theirs_die_with_a_sigkilled_process():
    assert _forked_after_sigkill("covered") == [False, False]
    # without it the forked child outlives its killed parent
    assert _forked_after_sigkill("plain")[0]
