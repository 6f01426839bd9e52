"""A local world's ranks write straight to the launcher's own stdout and stderr, not through mpiexec.

mpiexec.gforker forwards its ranks' output through pipes it reads in its event loop, but it stops reading
once the first rank has exited (from then on it only reaps, a rank a second) and drains what is left only
as it exits. The last lines of a failing run, the controller's traceback among them, therefore reached the
terminal or not depending on timing, and never when the launcher ended mpiexec as soon as the world was over.
So the launcher hands its stdout and stderr to the ranks as inherited descriptors, named with their identity
in ``ROLLHPC_CONSOLE``, and each rank puts them in place of mpiexec's pipes first thing: a line is on the
console once its write returns. Under another launcher (srun, or an mpiexec that does not pass descriptors on)
the variable is absent or names descriptors that are not the same files, and nothing changes.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "adopt_console", "console_for_ranks"]

ENV = "ROLLHPC_CONSOLE"


def console_for_ranks() -> tuple[dict[str, str], tuple[int, ...]]:
    """Duplicates of this process's stdout and stderr for the ranks: the environment entry naming them and the
    descriptors to pass on (``subprocess.Popen(pass_fds=...)``; the caller closes them once mpiexec started).
    Nothing when either stream is closed."""
    parts, fds = [], []
    for std in (1, 2):
        try:
            st = os.fstat(std)
        except OSError:
            for fd in fds:
                os.close(fd)
            return {}, ()
        fd = os.dup(std)
        fds.append(fd)
        parts.append(f"{std}={fd}:{st.st_dev}:{st.st_ino}")
    return {ENV: ",".join(parts)}, tuple(fds)


def adopt_console() -> bool:
    """In a rank: replace stdout and stderr by the launcher's own when ``ROLLHPC_CONSOLE`` names descriptors this
    process inherited (same device and inode); returns whether it did. The variable is removed, so what the rank
    starts (engines, sandboxes) does not look for descriptors it does not have."""
    spec = os.environ.pop(ENV, "")
    adopted = False
    for part in filter(None, spec.split(",")):
        try:
            std, rest = part.split("=", 1)
            fd, dev, ino = (int(x) for x in rest.split(":"))
            st = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if (st.st_dev, st.st_ino) != (dev, ino) or int(std) not in (1, 2):
            continue
        os.dup2(fd, int(std))
        os.close(fd)
        adopted = True
    return adopted
