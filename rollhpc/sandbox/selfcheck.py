"""``rollhpc sandbox check``: prove, on this machine, that the sandbox isolates and limits what it should.

Each check runs a real program in a real sandbox (all of them at once, in a pool) and looks at what it
could do: its uid, its network (only ``lo``, no DNS, no way to a listener this process opens on the
host's 127.0.0.1), what it can read (/etc/shadow, the home directory, the project) and write (anything
but its private /tmp), which processes it sees, and whether the limits hold (a fork storm, a memory
grab, a CPU burner, a big file, and a daemonised grandchild that must be gone after the deadline). Run
it on every kind of node the reward workers will use: ``srun rollhpc sandbox check``.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from textwrap import dedent

from rollhpc.sandbox.limits import SandboxLimits
from rollhpc.sandbox.pool import SandboxPool
from rollhpc.sandbox.result import SandboxResult
from rollhpc.sandbox.sandbox import Sandbox

CHECK_LIMITS = SandboxLimits(
    wall_s=5.0,
    cpu_s=1.0,
    memory_mb=128,
    nproc=16,
    nofile=32,
    fsize_mb=4,
    output_bytes=16_000,
    tmpfs_mb=16,
)
PROJECT_DIR = Path(__file__).resolve().parents[2]
LISTENER_CHECK = "no connection to a listener on the host's 127.0.0.1"


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class _Check:
    name: str
    source: str
    judge: Callable[[SandboxResult], tuple[bool, str]]
    timeout: float | None = None


def processes_with_marker(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line or name contains ``marker``."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/comm", "rb") as f:
                comm = f.read()
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline or marker.encode() in comm:
            found.append(int(pid))
    return found


def _printed(
    expect: Callable[[str], bool], describe: str
) -> Callable[[SandboxResult], tuple[bool, str]]:
    def judge(r: SandboxResult) -> tuple[bool, str]:
        out = r.stdout.strip()
        if r.status != "ok":
            return False, f"probe did not run: {r.status}: {r.detail}"
        return expect(out), f"{describe}: {out[:200]}"

    return judge


def _status(want: str, extra: Callable[[SandboxResult], bool] = lambda r: True) -> Callable:
    def judge(r: SandboxResult) -> tuple[bool, str]:
        return r.status == want and extra(r), f"{r.status}: {r.detail}"

    return judge


def _try(statement: str, imports: str = "") -> str:
    """A probe program: run ``statement``, print what it printed or ``failed <error>``."""
    return f"{imports}\ntry:\n    {statement}\nexcept OSError as e:\n    print('failed', e)\n"


_FORK_200 = dedent("""\
    import os, time
    n = 0
    for _ in range(200):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(2)
            os._exit(0)
        n += 1
    print(n)""")


def _write_outside_source(outside: list[str]) -> str:
    """A probe that tries to write each of ``outside`` and its private /tmp; prints the paths it
    could write."""
    return dedent(f"""\
        bad = []
        for path in {outside!r}:
            try:
                open(path, "w").write("x")
                bad.append(path)
            except OSError:
                pass
        open("/tmp/x", "w").write("x")
        print("wrote", bad)""")


def _daemon_source(marker: str) -> str:
    """A probe that leaves a daemonised grandchild and itself sleeping, both named ``marker``."""
    return dedent(f"""\
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", [{marker!r}, "60"])
            os._exit(0)
        os.execv("/bin/sleep", [{marker!r}, "60"])""")


def _checks(
    limits: SandboxLimits, port: int, home: str, marker: str, binds: tuple[str, ...]
) -> list[_Check]:
    return _isolation_checks(limits, port, home, binds) + _limit_checks(limits, marker)


def _isolation_checks(
    limits: SandboxLimits, port: int, home: str, binds: tuple[str, ...]
) -> list[_Check]:
    """What the program may see and touch: its uid, network, files and processes."""
    project = str(PROJECT_DIR)
    # the interpreter's own prefix may lie under home (a pyenv): its first path component is all
    # that may show
    allowed = sorted(
        {b[len(home) + 1 :].split("/")[0] for b in binds if b.startswith(home.rstrip("/") + "/")}
    )
    outside = ["/x", "/usr/x", "/dev/shm/x", "/etc/x", f"{home}/x", f"{project}/x"]
    failed = _printed(lambda out: out.startswith("failed"), "saw")
    return [
        _Check(
            "runs as a non-root uid",
            "import os; print(os.getuid(), os.geteuid(), os.getgid())",
            _printed(lambda out: "0" not in out.split(), "uid euid gid"),
        ),
        _Check(
            "network namespace has only lo",
            "import socket; print(*sorted(n for _, n in socket.if_nameindex()))",
            _printed(lambda out: out == "lo", "interfaces"),
        ),
        _Check(
            "DNS lookups fail",
            _try("print('resolved', socket.getaddrinfo('example.com', 443))", "import socket"),
            failed,
        ),
        _Check(
            LISTENER_CHECK,
            _try(
                f"socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')",
                "import socket",
            ),
            failed,
        ),
        _Check(
            "/etc/shadow unreadable", _try("print('read', open('/etc/shadow').read(1))"), failed
        ),
        _Check(
            f"home directory {home} invisible",
            _try(f"print('listed', os.listdir({home!r}))", "import os"),
            _printed(lambda out: out.startswith("failed") or out == f"listed {allowed!r}", "saw"),
        ),
        _Check(
            f"project directory {project} invisible",
            f"import os\nprint('exists' if os.path.exists({project!r}) else 'absent')",
            _printed(lambda out: out == "absent", "project"),
        ),
        _Check(
            "writes outside the private /tmp fail",
            _write_outside_source(outside),
            _printed(lambda out: out == "wrote []", "/tmp writable, others"),
        ),
        _Check(
            "host processes invisible (own pid namespace)",
            "import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))",
            _printed(lambda out: int(out) < limits.nproc, "processes seen"),
        ),
    ]


def _limit_checks(limits: SandboxLimits, marker: str) -> list[_Check]:
    """Whether the limits hold: processes, memory, CPU time, file size and the deadline."""
    mb = 1 << 20
    return [
        _Check(
            f"process limit holds ({limits.nproc})",
            _FORK_200,
            _printed(lambda out: int(out) < limits.nproc, "children started of 200 tried"),
        ),
        _Check(
            f"memory limit holds ({limits.memory_mb} MB)",
            f"x = bytearray({2 * limits.memory_mb * mb})",
            _status("memory"),
        ),
        _Check(
            f"CPU-time limit holds ({limits.cpu_s:g} s)",
            "while True:\n    pass",
            _status("timeout", lambda r: "CPU" in r.detail),
        ),
        _Check(
            f"file size limit holds ({limits.fsize_mb} MB)",
            f"with open('/tmp/big', 'wb') as f:\n    f.write(b'x' * {(limits.fsize_mb + 1) * mb})",
            _status("output_limit"),
        ),
        _Check(
            "deadline ends everything the program started (daemonised grandchild too)",
            _daemon_source(marker),
            _status("timeout"),
            timeout=1.0,
        ),
    ]


def run_checks(sandbox: Sandbox | None = None, workers: int | None = None) -> list[CheckResult]:
    """Every check, in order. Raises SandboxUnavailable when no sandbox can be made here."""
    sandbox = sandbox or Sandbox(CHECK_LIMITS)
    if sandbox.unsafe:
        return [CheckResult("sandbox is isolated", False, "unsafe=True: no isolation at all")]
    marker = f"rollhpc-selfcheck-{uuid.uuid4().hex[:12]}"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        checks = _checks(
            sandbox.limits,
            listener.getsockname()[1],
            str(Path.home()),
            marker,
            sandbox.interpreter.binds,
        )
        with SandboxPool(sandbox, workers) as pool:
            futures = [pool.submit(c.source, "", c.timeout) for c in checks]
            results = []
            for check, fut in zip(checks, futures):
                ok, detail = check.judge(fut.result())
                results.append(CheckResult(check.name, ok, detail))
        try:
            listener.accept()[0].close()
            accepted = True
        except BlockingIOError:
            accepted = False
    if accepted:
        results = [
            CheckResult(r.name, False, "the host listener accepted a connection")
            if r.name == LISTENER_CHECK
            else r
            for r in results
        ]
    left = processes_with_marker(marker)
    results.append(
        CheckResult(
            "nothing keeps running after the calls",
            not left,
            f"processes left: {left} (now killed)" if left else "none left",
        )
    )
    for pid in left:  # a failed check must not leave its sleepers behind either
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return results


def render(results: list[CheckResult], verbose: bool = False) -> list[str]:
    lines = []
    for r in results:
        line = f"{'isolated' if r.ok else 'NOT isolated':<13} {r.name}"
        if verbose or not r.ok:
            line += f"  ({r.detail})"
        lines.append(line)
    return lines
