"""What one sandboxed program may use: time, memory, processes, files and output.

Most limits are kernel resource limits (``setrlimit``) that the program's own process sets on itself
inside the sandbox, as the sandbox's non-root uid, just before the program starts (see launcher.py):
limits set by root outside are not enforced on root, and RLIMIT_NPROC only counts for a non-root uid.
Two are enforced from outside, by the runner: the wall-clock deadline and the output cap.

Per-process, not per-sandbox (the kernel's rlimits are per process): ``cpu_s`` and ``memory_mb`` bound
each process, so a program that forks ``nproc`` children can use up to ``nproc`` times as much in total
until the wall-clock deadline ends them all. ``nproc`` counts threads too (the kernel counts tasks).
"""

from __future__ import annotations

import math
import resource
from dataclasses import asdict, dataclass

MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    # wall-clock deadline: everything in the sandbox is killed after it (outside)
    wall_s: float = 10.0
    cpu_s: float = 10.0  # CPU seconds per process (RLIMIT_CPU: SIGXCPU, SIGKILL a second later)
    memory_mb: int = 512  # address space per process (RLIMIT_AS): MemoryError in Python
    # processes + threads of the sandbox's uid in its own user namespace (RLIMIT_NPROC)
    nproc: int = 32
    nofile: int = 64  # open file descriptors per process (RLIMIT_NOFILE)
    # largest file a process may write (RLIMIT_FSIZE: EFBIG in Python, else SIGXFSZ)
    fsize_mb: int = 16
    # stdout and stderr each; more ends the program (status output_limit)
    output_bytes: int = 64_000
    tmpfs_mb: int = 64  # size of the private /tmp, the only writable place (memory, not disk)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        for name in ("memory_mb", "nproc", "nofile", "fsize_mb", "output_bytes", "tmpfs_mb"):
            if int(getattr(self, name)) != getattr(self, name):
                raise ValueError(
                    f"SandboxLimits.{name} must be a whole number, got {getattr(self, name)!r}"
                )
        if self.nproc < 2:
            raise ValueError(
                "SandboxLimits.nproc must be at least 2 (the sandbox's init process counts)"
            )
        if self.nofile < 8:
            raise ValueError(
                "SandboxLimits.nofile must be at least 8 (the interpreter needs a few)"
            )

    def rlimits(self) -> dict[int, tuple[int, int]]:
        """resource.RLIMIT_* -> (soft, hard), as the launcher sets them inside the sandbox."""
        cpu = max(1, math.ceil(self.cpu_s))
        return {
            resource.RLIMIT_CPU: (cpu, cpu + 1),  # soft: SIGXCPU; hard one second later: SIGKILL
            resource.RLIMIT_AS: (self.memory_mb * MB,) * 2,
            resource.RLIMIT_NPROC: (self.nproc,) * 2,
            resource.RLIMIT_NOFILE: (self.nofile,) * 2,
            resource.RLIMIT_FSIZE: (self.fsize_mb * MB,) * 2,
            resource.RLIMIT_CORE: (0, 0),  # no core files (SIGXCPU's default action dumps core)
        }

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
