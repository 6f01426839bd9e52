"""Run untrusted Python programs (e.g. a policy's code answers) in bubblewrap sandboxes with limits.

    from rollhpc.sandbox import Sandbox, SandboxLimits, SandboxPool
    sb = Sandbox(limits=SandboxLimits(wall_s=5.0, cpu_s=5.0, memory_mb=256))
    r = sb.run("print(int(input()) * 2)", stdin="21")        # r.status == "ok", r.stdout == "42\\n"
    with SandboxPool(sb) as pool:
        results = pool.map([(source, stdin), ...])

Modules, one concern each: limits (what a program may use), launcher (the first lines run inside, which
set the limits), bwrap (finding bwrap and the interpreter, the command line), runner (spawn, deadline,
kill, reap), result (status and why), sandbox (the Sandbox: preflight, fail closed, unsafe mode, and the
list of what is NOT protected against), pool (concurrency), selfcheck (``rollhpc sandbox check``).
"""

from rollhpc.sandbox.bwrap import SandboxUnavailable
from rollhpc.sandbox.limits import SandboxLimits
from rollhpc.sandbox.pool import SandboxPool
from rollhpc.sandbox.result import STATUSES, SandboxResult, Status
from rollhpc.sandbox.sandbox import Sandbox

__all__ = [
    "STATUSES",
    "Sandbox",
    "SandboxLimits",
    "SandboxPool",
    "SandboxResult",
    "SandboxUnavailable",
    "Status",
]
