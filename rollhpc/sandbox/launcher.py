"""The few lines of Python that run first inside the sandbox and then become the program.

Why inside: the kernel enforces resource limits on the process that holds them, and only for a
non-root uid (RLIMIT_NPROC is not checked for root at all). So the sandbox's own first process, already
running as the sandbox uid, sets every limit on itself and closes every inherited descriptor above
stderr but one, the status pipe. Then it forks: the child closes the status pipe too and runs the
program in this same interpreter (no second exec: ~10 ms saved per program); the parent waits for it
and writes ``WAIT_STATUS UTIME STIME`` (``os.wait4``) to the status pipe, then exits with the child's
code (128+N for signal N). That line is how the runner learns the exact exit status and the CPU time:
bwrap itself reports signals as 128+N and exits before its own child is reaped, so its rusage misses
the program. The program can kill or impersonate its parent (same uid), which only hides its own exit
status and CPU time; the deadline and the limits do not depend on the line.

The program runs as ``__main__`` (``if __name__ == "__main__"`` works, its classes pickle), with
``sys.argv == [PATH]``; ``exit()``/``quit()`` are ``sys.exit`` (``-S`` skips the site module that
usually defines them). A traceback shows two launcher frames (``<string>``) above the program's. The
waiting parent counts against ``nproc`` (as does bwrap's init): a program may start ``nproc - 3`` more.
"""

from __future__ import annotations

from rollhpc.sandbox.limits import SandboxLimits

_LAUNCHER = """\
def _launch(path, limits, status_fd):
    import builtins, os, resource, sys
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 65536)
    for kind, pair in limits:
        resource.setrlimit(kind, pair)
    pid = os.fork()
    if pid:
        _, status, ru = os.wait4(pid, 0)
        os.write(status_fd, b"%d %.6f %.6f\\n" % (status, ru.ru_utime, ru.ru_stime))
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    os.close(status_fd)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    builtins.exit = builtins.quit = sys.exit
    sys.argv[:] = [path]
    main = sys.modules["__main__"].__dict__
    main.clear()
    main.update(__name__="__main__", __file__=path, __builtins__=builtins, __doc__=None, __loader__=None,
                __spec__=None, __package__=None)
    exec(code, main)
"""


def launcher_code(limits: SandboxLimits, program_path: str, status_fd: int) -> str:
    """Source for ``python -I -S -c``: set ``limits``, run the file at ``program_path`` in a child, report the
    child's wait status and CPU time on ``status_fd``."""
    pairs = tuple(sorted(limits.rlimits().items()))
    return f"{_LAUNCHER}_launch({program_path!r}, {pairs!r}, {status_fd})\n"
