"""One sandboxed process from start to reaped: spawn, read its output against a deadline, kill, reap.

The calling thread does all of it (a selector over stdout, stderr, bwrap's info pipe and the launcher's
status pipe), so a pool of threads runs many sandboxes at once: the waiting releases the GIL.

How nothing is left running. bwrap starts in a new process group (``start_new_session``); inside, its
own init (pid 1 of the sandbox's pid namespace) runs the program, and when pid 1 ends the kernel kills
every process of that namespace and waits until they are reaped, daemonised or ``setsid`` grandchildren
included. On the deadline (or too much output) the runner SIGKILLs that pid 1 (its host pid comes from
``--info-fd`` and is pinned by its start time), then bwrap's process group, and reaps bwrap. Should pid
1's host pid not be known yet (a kill within the first milliseconds), killing bwrap is enough:
``--die-with-parent`` SIGKILLs pid 1 when bwrap dies. Every call, killed or not, returns only once
stdout and stderr have reached end-of-file and pid 1 has exited (so the namespace is empty); if that
takes more than a few seconds after the end the result says so (``leftovers``) and a warning is logged.
bwrap exits without waiting for its pid 1, so that zombie (no memory, no CPU) is reaped by the host's
init, not by us.

Exit status and CPU time come from the launcher's status line (launcher.py); without one (the program was
killed, or killed its launcher) from bwrap's exit status (128+N = signal N) and, after a kill, from the
CPU counters of the sandbox's processes read from /proc just before it.

An exception in the caller's thread while a program runs (KeyboardInterrupt) kills and reaps it too.

Not covered: ``--die-with-parent`` is a parent-death signal tied to the *thread* that started bwrap: a
caller thread that exits while its sandbox still runs takes the sandbox with it. The unsafe mode (no bwrap)
kills only the program's process group: a child that calls setsid() escapes it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

log = logging.getLogger("rollhpc.sandbox")

DRAIN_AFTER_KILL_S = 3.0


@dataclass(frozen=True)
class Finished:
    returncode: int  # exit status, or -N when signal N ended the program
    stdout: bytes
    stderr: bytes
    truncated: bool
    killed_for: str | None  # "timeout" | "output_limit" when the runner ended it
    cpu_s: float
    wall_s: float
    leftovers: bool  # the output pipes stayed open after the kill: something may still run


class _Streams:
    """The pipes of one run: stdout/stderr (capped), and small side channels read whole (info, status)."""

    def __init__(self, out_fd: int, err_fd: int, side: tuple[int | None, ...], cap: int) -> None:
        self.sel = selectors.DefaultSelector()
        self.cap = cap
        self.bufs = {out_fd: bytearray(), err_fd: bytearray()}
        self.side = {fd: bytearray() for fd in side if fd is not None}
        self.open_outputs = {out_fd, err_fd}
        self.overflow = False
        for fd in [*self.bufs, *self.side]:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)

    def pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                self.sel.unregister(key.fd)
                self.open_outputs.discard(key.fd)
            elif key.fd in self.side:
                self.side[key.fd] += chunk[:4096]
            else:
                buf = self.bufs[key.fd]
                room = self.cap - len(buf)
                buf += chunk[:room]
                self.overflow |= len(chunk) > room

    def read_side(self, fd: int | None) -> bytes:
        """All of a side channel that has arrived so far."""
        if fd is None:
            return b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self.side[fd] += chunk
        return bytes(self.side[fd])

    def close(self) -> None:
        self.sel.close()
        for fd in self.side:
            os.close(fd)


def run_process(
    argv: list[str],
    *,
    stdin_fd: int,
    pass_fds: tuple[int, ...],
    wall_s: float,
    output_bytes: int,
    status_fd: int,
    info_fd: int | None = None,
    signal_exit_codes: bool = False,
    cwd: str = "/",
    env: dict[str, str] | None = None,
    user: int | None = None,
) -> Finished:
    """Run ``argv`` until it ends, ``wall_s`` passes or stdout/stderr exceed ``output_bytes``.

    ``pass_fds`` are closed here once the child has them; ``status_fd`` and ``info_fd`` are read ends of
    the launcher's status pipe and bwrap's ``--info-fd`` pipe, also closed here. ``signal_exit_codes``:
    without a status line, exit statuses 129..192 mean signal 1..64 (bwrap's way). ``user``: uid and gid
    to start argv as (root dropping to an unprivileged uid), through setpriv where there is one."""
    t0 = time.monotonic()
    proc = _spawn(argv, stdin_fd, pass_fds, (status_fd, info_fd), cwd, env, user)
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    run = _Run(proc, _Streams(out_fd, err_fd, (status_fd, info_fd), output_bytes), info_fd)
    try:
        run.watch(t0 + wall_s)
        end = run.kill_and_drain() if run.killed_for is not None else None
        rusage, leftovers = run.reap(end)
        report = _parse_status(run.streams.read_side(status_fd))
    finally:
        run.close()
    code, cpu_s = run.code_and_cpu(report, rusage, signal_exit_codes)
    if leftovers:
        log.warning(
            "sandbox: processes of a sandbox still ran %.0f s after its end or kill (argv[0] %s)",
            DRAIN_AFTER_KILL_S,
            argv[0],
        )
    return Finished(
        returncode=code,
        stdout=bytes(run.streams.bufs[out_fd]),
        stderr=bytes(run.streams.bufs[err_fd]),
        truncated=run.streams.overflow,
        killed_for=run.killed_for,
        cpu_s=cpu_s,
        wall_s=time.monotonic() - t0,
        leftovers=leftovers,
    )


class _Run:
    """One spawned process while it runs: its output read to the deadline, the kill, the reap."""

    def __init__(self, proc: subprocess.Popen, streams: _Streams, info_fd: int | None) -> None:
        self.proc, self.streams, self.info_fd = proc, streams, info_fd
        self.init: _SandboxInit | None = None  # the sandbox's pid 1, once bwrap's info says which
        self.killed_for: str | None = None  # "timeout" | "output_limit" when the runner ends it
        self.kill_cpu_s: float | None = None  # the sandbox's CPU time just before the kill

    def watch(self, deadline: float) -> None:
        """Read stdout and stderr until both reach end-of-file, or set ``killed_for`` when the
        deadline passes or the output exceeds its cap first."""
        streams = self.streams
        while streams.open_outputs:
            left = deadline - time.monotonic()
            if left <= 0:
                self.killed_for = "timeout"
                break
            streams.pump(left)
            if self.init is None and self.info_fd is not None:
                self.init = _SandboxInit.find(streams.side[self.info_fd], self.proc.pid)
            if streams.overflow:
                self.killed_for = "output_limit"
                break
        if self.init is None and self.info_fd is not None:
            self.init = _SandboxInit.find(streams.read_side(self.info_fd), self.proc.pid)

    def _live_init_pid(self) -> int | None:
        return self.init.pid if self.init is not None and self.init.alive() else None

    def kill_and_drain(self) -> float:
        """Kill the sandbox and read what its pipes still hold for at most DRAIN_AFTER_KILL_S;
        returns the time that drain ends."""
        self.kill_cpu_s = self.init.cpu_s() if self.init is not None else None
        _kill(self.proc.pid, self._live_init_pid())
        end = time.monotonic() + DRAIN_AFTER_KILL_S
        while self.streams.open_outputs and time.monotonic() < end:
            self.streams.pump(end - time.monotonic())
        return end

    def reap(self, end: float | None) -> tuple[resource.struct_rusage, bool]:
        """Wait for bwrap; returns its rusage and whether something may still run (``leftovers``: an
        output pipe still open, or pid 1 alive past ``end``)."""
        _, status, rusage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        # the namespace is empty once its pid 1 has exited (the kernel kills and reaps the rest)
        leftovers = bool(self.streams.open_outputs) or (
            self.init is not None
            and not self.init.wait_gone(end or time.monotonic() + DRAIN_AFTER_KILL_S)
        )
        return rusage, leftovers

    def close(self) -> None:
        """Close the pipes; after an exception while it ran (KeyboardInterrupt...), kill and reap it
        first."""
        if self.proc.returncode is None:
            _kill(self.proc.pid, self._live_init_pid())
            os.waitpid(self.proc.pid, 0)
            self.proc.returncode = -signal.SIGKILL
        self.streams.close()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()

    def code_and_cpu(
        self,
        report: tuple[int, float] | None,
        rusage: resource.struct_rusage,
        signal_exit_codes: bool,
    ) -> tuple[int, float]:
        """(exit code or -signal, CPU seconds): the launcher's status line when there is one, else
        what the kill or bwrap's exit status and rusage say."""
        if report is not None:
            return report
        code = (
            -signal.SIGKILL
            if self.killed_for is not None
            else _exit_code(self.proc.returncode, signal_exit_codes)
        )
        cpu_s = (
            self.kill_cpu_s if self.kill_cpu_s is not None else rusage.ru_utime + rusage.ru_stime
        )
        return code, cpu_s


def _spawn(
    argv: list[str],
    stdin_fd: int,
    pass_fds: tuple[int, ...],
    read_ends: tuple[int | None, ...],
    cwd: str,
    env: dict[str, str] | None,
    user: int | None,
) -> subprocess.Popen:
    """``argv`` started in a session of its own with stdout and stderr piped, as ``user`` when given; the
    ``pass_fds`` are closed here once the child has them, and the ``read_ends`` too if it cannot start."""
    ids: dict = {}
    if user is not None and _setpriv():
        argv = [_setpriv(), f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv]
    elif user is not None:
        ids = {"user": user, "group": user, "extra_groups": []}
    try:
        return subprocess.Popen(
            argv,
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            cwd=cwd,
            env=env if env is not None else {},
            start_new_session=True,
            **ids,
        )
    except BaseException:
        for fd in read_ends:
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in pass_fds:
            os.close(fd)


def _exit_code(returncode: int, signal_exit_codes: bool) -> int:
    """A process's exit code with no status line to say it; 129..192 mean signal 1..64 where asked (bwrap's way)."""
    return -(returncode - 128) if signal_exit_codes and 128 < returncode <= 128 + 64 else returncode


@functools.cache
def _setpriv() -> str | None:
    """util-linux's setpriv, to switch uid in the child after exec: Popen(user=...) cannot use vfork, and a
    plain fork of a large caller is slow (a 2 GB caller here: 108 ms per start, against 4 ms through setpriv)."""
    return shutil.which("setpriv")


def _parse_status(line: bytes) -> tuple[int, float] | None:
    """The launcher's ``WAIT_STATUS UTIME STIME`` line -> (exit code or -signal, CPU seconds)."""
    try:
        status, utime, stime = line.split(b"\n", 1)[0].split()
        return os.waitstatus_to_exitcode(int(status)), float(utime) + float(stime)
    except ValueError:
        return None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name (index 0: state, 1: ppid, 19: start time), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class _SandboxInit:
    """The sandbox's pid 1 as the host sees it (from bwrap's --info-fd), pinned by its start time."""

    pid: int
    start: str
    pid_ns: str

    @classmethod
    def find(cls, info: bytes | bytearray, bwrap_pid: int) -> _SandboxInit | None:
        try:
            doc = json.loads(bytes(info))
            pid, pid_ns = int(doc["child-pid"]), f"pid:[{int(doc['pid-namespace'])}]"
        except (ValueError, KeyError, TypeError):
            return None  # not all there yet
        fields = _stat(pid)
        try:
            ours = (
                fields is not None
                and int(fields[1]) == bwrap_pid
                and os.readlink(f"/proc/{pid}/ns/pid") == pid_ns
            )
        except OSError:
            ours = False
        # not ours (any more): it already ended and was reaped; wait_gone and alive then answer for a dead one
        return cls(pid, fields[19] if ours else "", pid_ns)

    def alive(self) -> bool:
        fields = _stat(self.pid)
        return (
            bool(self.start)
            and fields is not None
            and fields[19] == self.start
            and fields[0] not in "ZX"
        )

    def wait_gone(self, until: float) -> bool:
        while self.alive():
            if time.monotonic() >= until:
                return False
            time.sleep(0.0002)
        return True

    def cpu_s(self) -> float | None:
        """CPU seconds of the processes alive in the sandbox's pid namespace and of the children they reaped."""
        ticks, total = os.sysconf("SC_CLK_TCK"), 0
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return None
        for pid in pids:
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") != self.pid_ns:
                    continue
            except OSError:
                continue
            fields = _stat(int(pid))
            if fields is not None:
                total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return total / ticks


def _kill(bwrap_pid: int, init_pid: int | None) -> None:
    """SIGKILL the sandbox's pid 1 (the kernel then kills the rest of its pid namespace), then bwrap's group."""
    for kill, pid in ((os.kill, init_pid), (os.killpg, bwrap_pid)):
        if pid is not None:
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
