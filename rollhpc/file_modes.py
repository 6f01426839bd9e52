"""Files and folders rollhpc writes get the modes the user's umask gives, as ``open`` and ``mkdir`` would.

``tempfile.mkstemp`` and ``mkdtemp`` (what atomic writes and staged checkpoint folders start from) create
0600 files and 0700 folders whatever the umask, and a rename keeps the mode: without this, colleagues on a
project filesystem could not read a run's reports, checkpoints or exported models. Leaf module: no rollhpc
imports, so every layer may use it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()


def current_umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc/self/status, 4.7+)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _lock:  # elsewhere the only way to read it is to set it, and set it back
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def file_mode() -> int:
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    return 0o777 & ~current_umask()


def mkstemp(prefix: str, dir: Path) -> tuple[int, str]:
    """``tempfile.mkstemp`` whose file has the umask's mode (it is renamed into place as it is)."""
    fd, path = tempfile.mkstemp(prefix=prefix, dir=dir)
    os.fchmod(fd, file_mode())
    return fd, path


def mkdtemp(prefix: str, dir: Path) -> str:
    """``tempfile.mkdtemp`` whose folder has the umask's mode (it is renamed into place as it is)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    os.chmod(path, dir_mode())
    return path
