"""What a sandboxed run came to: one status out of six, and why, from what the runner saw.

Pure logic (no processes): the runner hands over the exit status, what it killed the program for, the
CPU time and stderr's last line; ``classify`` names the status.

  ok            exit status 0
  timeout       wall-clock deadline (killed from outside) or CPU-time limit (SIGXCPU, or SIGKILL at the hard
                limit)
  memory        MemoryError / ENOMEM under the address-space limit (Python's last traceback line)
  output_limit  stdout or stderr over ``output_bytes`` (killed from outside), a file over ``fsize_mb``
                (EFBIG, or SIGXFSZ for a program that does not ignore it), or the private /tmp full (ENOSPC)
  killed        any other signal (SIGSEGV, SIGKILL from elsewhere, SIGABRT, ...)
  error         any other non-zero exit: an exception, sys.exit(1), a failed fork at the process limit
                (BlockingIOError, "Resource temporarily unavailable")

Limits of the reading: bwrap reports a program killed by signal N as exit status 128+N, so a program
that calls exit(128+N) itself reads as killed by N; a program that catches MemoryError and exits 1 with
its own message reads as ``error``; and a program can print a fake traceback line.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass
from typing import Literal

from rollhpc.sandbox.limits import SandboxLimits

Status = Literal["ok", "timeout", "memory", "output_limit", "killed", "error"]
STATUSES: tuple[Status, ...] = ("ok", "timeout", "memory", "output_limit", "killed", "error")


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    exit_code: (
        int  # the program's exit status; -N when a signal N ended it (-9 when the runner killed it)
    )
    stdout: str  # at most limits.output_bytes bytes each (decoded as UTF-8, bad bytes replaced)
    stderr: str
    cpu_s: float  # user + system CPU of everything the sandbox reaped (os.wait4 on bwrap)
    wall_s: float  # from start to everything reaped
    detail: str = ""  # one line: why this status
    truncated: bool = False  # stdout or stderr was cut at output_bytes

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> list[str]:
        """Human-readable: a summary line, then stdout and stderr when not empty."""
        lines = [
            f"status {self.status}: {self.detail}; exit code {self.exit_code}; wall {self.wall_s:.3f} s, "
            f"cpu {self.cpu_s:.3f} s" + ("; output truncated" if self.truncated else "")
        ]
        for name in ("stdout", "stderr"):
            text = getattr(self, name)
            if text:
                lines += [f"--- {name} ---", text.rstrip("\n")]
        return lines


def _last_line(stderr: bytes) -> str:
    lines = [ln for ln in stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def classify(
    *,
    returncode: int,
    killed_for: str | None,
    stderr: bytes,
    cpu_s: float,
    limits: SandboxLimits,
    wall_s: float,
) -> tuple[Status, str]:
    """(status, detail) of a finished run. ``killed_for``: "timeout" or "output_limit" when the runner ended
    it, else None. ``returncode``: exit status, or -N for signal N. ``wall_s``: the deadline that applied."""
    if killed_for == "timeout":
        return "timeout", f"wall-clock limit of {wall_s:g} s reached: killed"
    if killed_for == "output_limit":
        return "output_limit", f"more than {limits.output_bytes} bytes on stdout or stderr: killed"
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s):
            return (
                "timeout",
                f"CPU-time limit of {limits.cpu_s:g} s reached ({signal.Signals(sig).name})",
            )
        if sig == signal.SIGXFSZ:
            return "output_limit", f"file size limit of {limits.fsize_mb} MB reached (SIGXFSZ)"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "killed", f"killed by {name}"
    if returncode == 0:
        return "ok", "exited with 0"
    last = _last_line(stderr)
    if last.startswith("MemoryError") or "[Errno 12]" in last:
        return "memory", f"address-space limit of {limits.memory_mb} MB reached: {last[:200]}"
    if "[Errno 27]" in last:  # EFBIG: Python ignores SIGXFSZ, so the write fails instead
        return "output_limit", f"file size limit of {limits.fsize_mb} MB reached: {last[:200]}"
    if "[Errno 28]" in last:  # ENOSPC: the private /tmp is full
        return "output_limit", f"private /tmp of {limits.tmpfs_mb} MB full: {last[:200]}"
    return "error", f"exited with {returncode}" + (f": {last[:200]}" if last else "")
