"""Run a command with N CPU-hog processes beside it: the test suite as a busy CI machine runs it.

    python tools/cpu_hogs.py [-n N] -- COMMAND [ARGS...]

The hogs (N busy loops, default 2) start first and are killed when COMMAND ends, however it ends; each hog
also has a parent-death signal, so a SIGKILLed runner takes them with it. Ctrl-C reaches COMMAND (the
foreground group's signal); SIGTERM to the runner is passed on to it. The exit status is COMMAND's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _hog(parent: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the runner died before the signal was asked for
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        pass


def start_hogs(n: int) -> list[int]:
    me, pids = os.getpid(), []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                _hog(me)
            finally:
                os._exit(0)
        pids.append(pid)
    return pids


def stop_hogs(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "-n", "--hogs", type=int, default=2, help="busy-loop processes to run beside COMMAND"
    )
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given")
    hogs = start_hogs(args.hogs)
    print(
        f"cpu_hogs: {len(hogs)} hog processes running ({', '.join(map(str, hogs))})",
        file=sys.stderr,
        flush=True,
    )
    try:
        child = subprocess.Popen(command)
        # the terminal's Ctrl-C reaches the command itself
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, _: child.send_signal(signum))
        return child.wait()
    finally:
        stop_hogs(hogs)
        print("cpu_hogs: hogs stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
