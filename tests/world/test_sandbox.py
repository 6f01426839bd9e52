"""The code sandbox with real bubblewrap processes: isolation, limits, cleanup, concurrency, fail-closed.

Every program that could leave something behind names its processes with a unique marker (prctl
PR_SET_NAME, or argv[0] for exec'd ones) and the test checks /proc for it right after the call returns.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import socket
import tempfile
import time
import uuid
from pathlib import Path
from textwrap import dedent

import pytest

from rollhpc.sandbox import Sandbox, SandboxLimits, SandboxPool, SandboxUnavailable
from rollhpc.sandbox.limits import MB
from rollhpc.sandbox.result import classify
from rollhpc.sandbox.selfcheck import processes_with_marker
from tests.support.processes import REPO, rollhpc

LIMITS = SandboxLimits(
    wall_s=3.0,
    cpu_s=1.0,
    memory_mb=128,
    nproc=16,
    nofile=32,
    fsize_mb=4,
    output_bytes=8000,
    tmpfs_mb=16,
)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap cannot make a sandbox on this machine: {e}")


@pytest.fixture
def marker() -> str:
    return f"sbx{uuid.uuid4().hex[:10]}"  # fits a process name (15 bytes)


def named(marker: str, body: str) -> str:
    """``body`` preceded by naming this process (and every child it forks) ``marker``."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\n{body}"


def assert_nothing_left(marker: str) -> None:
    left = processes_with_marker(marker)
    assert not left, f"sandbox processes still running after the call: {left}"


# ------------------------------------------------------------------ runs and isolation
def test_ok_stdin_and_exit_codes(sandbox):
    r = sandbox.run("print(int(input()) * 2)", stdin="21")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "42\n", "")
    assert 0 < r.wall_s < 3 and r.cpu_s >= 0
    r = sandbox.run("import sys\nprint('bad', file=sys.stderr)\nexit(3)")
    assert (r.status, r.exit_code, r.stderr) == ("error", 3, "bad\n")
    r = sandbox.run("raise ValueError('boom')")
    assert r.status == "error" and r.detail.endswith("ValueError: boom")
    r = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert (r.status, r.exit_code) == ("killed", -signal.SIGSEGV)


def test_network_is_cut_off(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        r = sandbox.run(
            dedent(f"""\
            import socket
            print(*sorted(n for _, n in socket.if_nameindex()))
            for what, call in (("dns", lambda: socket.getaddrinfo("example.com", 443)),
                               ("host", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1))):
                try:
                    call()
                    print(what, "reached")
                except OSError as e:
                    print(what, "failed", e.errno)""")
        )
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "lo"
    assert lines[1].startswith("dns failed") and lines[2].startswith("host failed"), lines


def test_host_files_are_unreadable(sandbox):
    paths = [
        str(REPO),
        str(REPO / "README.md"),
        "/root",
        "/root/.bashrc",
        "/etc/shadow",
        "/etc/passwd",
        str(Path.home()),
    ]
    r = sandbox.run(f"import os\nfor p in {paths!r}:\n    print(p, os.path.exists(p))")
    assert r.status == "ok", r.stderr
    assert r.stdout.split() == [x for p in paths for x in (p, "False")]


def test_writes_outside_private_tmp_fail(sandbox):
    targets = ["/x", "/usr/x", "/dev/shm/x", "/etc/x", "/proc/x", "/root/x", f"{REPO}/x"]
    r = sandbox.run(
        dedent(f"""\
        written = []
        for path in {targets!r}:
            try:
                open(path, "w").write("x")
                written.append(path)
            except OSError:
                pass
        open("/tmp/ok", "w").write("x")
        print(written)""")
    )
    assert (r.status, r.stdout) == ("ok", "[]\n"), r.stderr
    assert not (REPO / "x").exists()


def test_runs_as_nobody_in_own_pid_namespace(sandbox):
    r = sandbox.run(
        "import os\nprint(os.getuid(), os.getgid(), len([p for p in os.listdir('/proc') if p.isdigit()]))"
    )
    uid, gid, nprocs = map(int, r.stdout.split())
    assert (uid, gid) == (65534, 65534) and nprocs <= 3  # bwrap's init, the launcher, the program


# ------------------------------------------------------------------ limits, statuses, cleanup
def test_fork_bomb_is_contained(sandbox, marker):
    r = sandbox.run(named(marker, "import os\nwhile True:\n    os.fork()\n"))
    assert r.status == "error" and "Resource temporarily unavailable" in r.stderr, (
        r.status,
        r.detail,
    )
    assert_nothing_left(marker)


def test_process_limit_is_per_sandbox(sandbox, marker):
    """300 fork attempts stop at nproc; two sandboxes at once each get their own budget (per-namespace count)."""
    body = dedent("""\
        import os, sys, time
        n = 0
        for _ in range(int(sys.stdin.read())):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(1)
                os._exit(0)
            n += 1
        print(n)""")
    r = sandbox.run(named(marker, body), stdin="300")
    assert r.status == "ok" and 0 < int(r.stdout) < LIMITS.nproc, (r.stdout, r.detail)
    want = LIMITS.nproc - 4
    with SandboxPool(sandbox, workers=2) as pool:
        both = pool.map([(named(marker, body), str(want))] * 2)
    assert [int(x.stdout) for x in both] == [want, want]
    assert_nothing_left(marker)


def test_memory_bomb(sandbox):
    r = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert r.status == "memory" and "MemoryError" in r.stderr, r.detail


def test_infinite_loop_hits_the_wall_clock(sandbox, marker):
    t = time.monotonic()
    # CPU limit (1 s) not reached
    r = sandbox.run(named(marker, "while True:\n    pass"), timeout=0.5)
    assert r.status == "timeout" and "wall-clock" in r.detail and r.exit_code == -signal.SIGKILL
    assert time.monotonic() - t < 2.0
    assert r.cpu_s > 0.05  # read from the sandbox's processes before the kill
    assert_nothing_left(marker)


def test_cpu_burner_hits_the_cpu_limit(sandbox):
    r = sandbox.run("while True:\n    pass", timeout=5.0)
    assert r.status == "timeout" and "CPU" in r.detail and r.exit_code == -signal.SIGXCPU
    # rusage may count less than the CPU limit's clock on a VM whose host is busy (steal time): only roughly
    assert 0.3 < r.cpu_s < 2.5 and r.wall_s < 4.0


def test_big_file_write_hits_the_file_size_limit(sandbox):
    r = sandbox.run(
        "with open('/tmp/big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))"
    )
    assert r.status == "output_limit" and "File too large" in r.stderr, r.detail


def test_full_private_tmp_is_output_limit(sandbox):
    r = sandbox.run("for i in range(8):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (3 << 20))")
    assert r.status == "output_limit" and "No space left" in r.stderr, r.detail


def test_output_cap(sandbox, marker):
    r = sandbox.run(named(marker, "while True:\n    print('y' * 999)"))
    assert (r.status, r.truncated, len(r.stdout)) == ("output_limit", True, LIMITS.output_bytes)
    assert_nothing_left(marker)


def test_sigterm_ignoring_program_is_killed(sandbox, marker):
    body = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.1)"
    r = sandbox.run(named(marker, body), timeout=0.5)
    assert r.status == "timeout"
    assert_nothing_left(marker)


@pytest.mark.parametrize("main_waits", [False, True], ids=["main-exits", "main-hangs"])
def test_daemonised_grandchild_does_not_survive(sandbox, marker, main_waits):
    body = dedent("""\
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.closerange(0, 3)  # holds none of the sandbox's pipes
                time.sleep(60)
            os._exit(0)
        time.sleep(0.3)
        print("spawned", flush=True)
        """) + ("time.sleep(60)\n" if main_waits else "")
    r = sandbox.run(named(marker, body), timeout=1.0)
    assert r.stdout == "spawned\n"
    assert r.status == ("timeout" if main_waits else "ok"), r.detail
    assert_nothing_left(marker)


# ------------------------------------------------------------------ pool, fail closed, unsafe
def test_pool_runs_programs_concurrently(sandbox):
    jobs = [(f"import time\ntime.sleep(0.5)\nprint({i} * int(input()))", "2") for i in range(8)]
    t = time.monotonic()
    with SandboxPool(sandbox, workers=4) as pool:
        results = pool.map(jobs)
        one = pool.submit("print('single')").result()
    elapsed = time.monotonic() - t
    assert [r.stdout for r in results] == [f"{2 * i}\n" for i in range(8)]
    assert one.stdout == "single\n"
    assert elapsed < 3.0, f"8 x 0.5 s on 4 workers took {elapsed:.1f} s"
    assert SandboxPool(sandbox).workers == len(os.sched_getaffinity(0))


def test_missing_bwrap_fails_closed():
    with pytest.raises(SandboxUnavailable, match="does not exist.*install bubblewrap"):
        Sandbox(LIMITS, bwrap="/nonexistent/bwrap")


def test_bwrap_that_cannot_make_namespaces_fails_closed():
    """A bwrap that exists but fails (as it does where user namespaces are off) -> one clear error, nothing runs."""
    # reachable by uid 65534 (bwrap is started as it under root)
    fake_dir = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        fake = fake_dir / "bwrap"
        fake.write_text(
            "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'bubblewrap 0.9.0'; exit 0; }\n"
            "echo 'bwrap: No permissions to create new namespace' >&2; exit 1\n"
        )
        fake.chmod(0o755)
        fake_dir.chmod(0o755)
        with pytest.raises(
            SandboxUnavailable, match="cannot create a sandbox.*No permissions.*user namespaces"
        ):
            Sandbox(LIMITS, bwrap=str(fake))
    finally:
        shutil.rmtree(fake_dir)


def test_unsafe_mode_warns_every_time(caplog):
    with caplog.at_level(logging.WARNING, logger="rollhpc.sandbox"):
        sb = Sandbox(LIMITS, unsafe=True, bwrap="/nonexistent/bwrap")
        Sandbox(LIMITS, unsafe=True)
    warnings = [rec for rec in caplog.records if "UNSAFE SANDBOX" in rec.getMessage()]
    assert len(warnings) == 2 and all(rec.levelno == logging.WARNING for rec in warnings)
    r = sb.run("print(int(input()) + 1)", stdin="1")
    assert (r.status, r.stdout) == ("ok", "2\n")
    assert sb.run("while True:\n    pass", timeout=0.3).status == "timeout"


def test_classify_reads_signals_and_tracebacks():
    def status(rc, stderr=b"", killed_for=None, cpu_s=0.0):
        return classify(
            returncode=rc,
            killed_for=killed_for,
            stderr=stderr,
            cpu_s=cpu_s,
            limits=LIMITS,
            wall_s=LIMITS.wall_s,
        )[0]

    assert status(0) == "ok" and status(2) == "error"
    assert status(-signal.SIGXCPU) == "timeout" and status(-signal.SIGKILL, cpu_s=1.5) == "timeout"
    assert status(-signal.SIGKILL) == "killed" and status(-signal.SIGXFSZ) == "output_limit"
    assert status(1, b"Traceback ...\nMemoryError\n") == "memory"
    assert status(1, b"OSError: [Errno 27] File too large\n") == "output_limit"
    assert (
        status(-9, killed_for="timeout") == "timeout"
        and status(-9, killed_for="output_limit") == "output_limit"
    )
    with pytest.raises(ValueError, match="nproc"):
        SandboxLimits(nproc=0)
    assert LIMITS.rlimits()[resource.RLIMIT_AS] == (128 * MB, 128 * MB)


# ------------------------------------------------------------------ command line
def test_cli_run(tmp_path, sandbox):
    prog, stdin = tmp_path / "p.py", tmp_path / "in.txt"
    prog.write_text("print(int(input()) * 3)\n")
    stdin.write_text("14\n")
    out = rollhpc(
        "sandbox",
        "run",
        str(prog),
        "--stdin",
        str(stdin),
        "--timeout",
        "5",
        "--json",
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["status"], doc["stdout"]) == ("ok", "42\n")
    prog.write_text("import time\ntime.sleep(5)\n")
    out = rollhpc("sandbox", "run", str(prog), "--timeout", "0.3", cwd=tmp_path, timeout=60)
    assert out.returncode == 1 and out.stdout.startswith("status timeout"), out.stdout


def test_cli_check(tmp_path, sandbox):
    out = rollhpc("sandbox", "check", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()[1:]
    assert len(lines) >= 14 and all(line.startswith("isolated ") for line in lines), out.stdout
