"""A run's ``checkpoints/`` folder: checkpoints written atomically, verified before use.

Layout::

    checkpoints/
      step_000120/               committed: the writers' files + manifest.json (path, size, sha256 of each)
      step_000123/
      latest                     "step_000123": the last commit (a text file replaced by rename, never a symlink)
      .step_000126.tmp-k3j9x0    being written, or left behind by a crash
      .step_000117.trash-p2q8    being deleted, or left behind by a crash

Writing (``begin`` -> writers -> ``commit``): ``begin(step)`` makes a hidden temporary directory; any
number of processes (every trainer rank, the controller) write their files into ``pending.path``;
once all of them have finished (the caller orders that, e.g. with a barrier), ONE process calls
``commit``. It hashes every file, writes ``manifest.json``, renames the directory to ``step_N/`` and
then points ``latest`` at it. A crash at any moment leaves either the previous state or the new one
plus debris in hidden ``.tmp-``/``.trash-`` entries, which readers ignore.

Durability, in order: each file is fsynced as commit hashes it (an fsync on a new descriptor flushes
the file's dirty pages on a local filesystem whichever process wrote them; on a shared filesystem a
writer on another node should close its files, and may call ``fsync_tree`` on its own subfolder,
before it reports done), then every subdirectory, the manifest (temp + fsync + rename), the
temporary directory; rename to ``step_N``, fsync of ``checkpoints/``; the ``latest`` pointer (temp +
fsync + rename + fsync of ``checkpoints/``). Only then are older checkpoints pruned. Atomic steps: the
rename of the directory (a checkpoint appears complete or not at all), the rename of ``latest`` (it
names a complete checkpoint or the previous one), the rename of a checkpoint into ``.trash-`` before it
is deleted (a half-deleted checkpoint is never visible as ``step_N``).

Who deletes: only a writing store, in ``begin``/``recover``/``commit``. A run has one writer session at a
time (its controller; a requeued job starts a new one only after the old job is gone), so a new
store removes every ``.tmp-``/``.trash-`` entry it did not create itself: whatever a previous session
left half-written can never be completed. Readers (``list``, ``verify``, ``latest_good``, the
``rollhpc ckpt`` commands) never delete anything and may run on a login node during training.

Reading: ``latest_good`` takes the newest ``step_N`` (by step) whose files match its manifest, and
falls back to older ones, logging each one it skips and why. It trusts the manifests rather than the
pointer, so a crash between the rename and the pointer update loses nothing. A commit deletes
checkpoints newer than itself: they belong to a trajectory the run left when it resumed from an
older checkpoint, and must not be picked up by the next restart.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollhpc import file_modes
from rollhpc.rundir import atomic_write_bytes, fsync_dir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "rollhpc-checkpoint"
FORMAT_VERSION = 1
STEP_DIR_RE = re.compile(r"step_(\d+)")
TMP_DIR_RE = re.compile(r"\.step_(\d+)\.tmp-\w+")
# hidden temporaries: ours, from this or an earlier session
_DEBRIS = re.compile(r"\..+\.(tmp|trash)-\w+")
_CHUNK = 1 << 22
_HASH_THREADS = min(8, os.cpu_count() or 1)  # hashlib releases the GIL on large buffers


class CheckpointStorageError(RuntimeError):
    """A checkpoint that is missing, unreadable, or cannot be committed."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---- records ----


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    created: float  # unix time of the commit
    meta: dict[str, Any]  # the caller's, JSON
    files: dict[str, FileEntry]  # relative POSIX path -> entry; manifest.json itself not included

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "total_bytes": self.nbytes,
            "meta": self.meta,
            "files": {rel: {"size": e.size, "sha256": e.sha256} for rel, e in self.files.items()},
        }

    @classmethod
    def read(cls, ckpt_dir: Path) -> Manifest:
        path = Path(ckpt_dir) / MANIFEST
        try:
            data = json.loads(path.read_bytes())
            if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
                raise ValueError(
                    f"format {data.get('format')!r} version {data.get('version')!r}, expected "
                    f"{FORMAT!r} version {FORMAT_VERSION}"
                )
            files = {
                rel: FileEntry(int(e["size"]), str(e["sha256"])) for rel, e in data["files"].items()
            }
            return cls(int(data["step"]), float(data["created"]), dict(data["meta"]), files)
        except FileNotFoundError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointStorageError(f"{path}: unreadable ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint (its manifest was readable; ``verify`` says whether its files still match)."""

    step: int
    path: Path
    manifest: Manifest

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.meta


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written: writers put their files under ``path`` (a string other processes can
    be sent), then one process commits it."""

    step: int
    path: Path


Status = Literal["ok", "corrupt", "partial"]


@dataclass(frozen=True)
class CheckpointStatus:
    """One row of ``CheckpointStore.statuses``: ``partial`` is a write that never committed (a ``.tmp-``
    directory, or a ``step_N`` without manifest), ``corrupt`` a commit whose files no longer match."""

    name: str
    step: int
    path: Path
    status: Status
    problems: tuple[str, ...]
    manifest: Manifest | None


# ---- files: hashing, fsync, atomic replace, verification ----


def sha256_file(path: Path, *, fsync: bool = False) -> str:
    """sha256 of a file read in 4 MiB chunks; ``fsync`` also flushes it to stable storage."""
    return _hash(path, fsync)[1]


def _hash(path: Path, fsync: bool) -> tuple[int, str]:
    """(bytes read, sha256): the size recorded is the size hashed."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return n, h.hexdigest()


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (for a writer on a node other than the committer's)."""
    for dirpath, _, names in os.walk(path, topdown=False):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _files(root: Path) -> dict[str, Path]:
    """Relative POSIX path -> path for every file under ``root``, manifest.json excluded."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath, name)
            rel = p.relative_to(root).as_posix()
            if rel != MANIFEST:
                out[rel] = p
    return dict(sorted(out.items()))


def _hash_all(paths: dict[str, Path], *, fsync: bool) -> dict[str, FileEntry]:
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return dict(zip(paths, pool.map(lambda p: FileEntry(*_hash(p, fsync)), paths.values())))


def check_dir(ckpt_dir: Path, *, deep: bool = True) -> tuple[Manifest | None, builtins.list[str]]:
    """Compare a checkpoint directory with its manifest: file set and sizes, and sha256 when ``deep``.
    Returns the manifest (None when missing or unreadable) and one line per problem (none: good)."""
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = Manifest.read(ckpt_dir)
    except FileNotFoundError:
        return None, [f"no {MANIFEST}: a partial write (never committed)"]
    except CheckpointStorageError as e:
        return None, [f"{MANIFEST}: unreadable ({e.__cause__})"]
    m = STEP_DIR_RE.fullmatch(ckpt_dir.name)
    problems = []
    if m and int(m.group(1)) != manifest.step:
        problems.append(
            f"{MANIFEST} says step {manifest.step}, the directory is named {ckpt_dir.name}"
        )
    present = _files(ckpt_dir)
    same_size = {}
    for rel, entry in manifest.files.items():
        if rel not in present:
            problems.append(f"{rel}: missing")
            continue
        size = present[rel].stat().st_size
        if size != entry.size:
            how = "truncated" if size < entry.size else "grown"
            problems.append(f"{rel}: {size} bytes, the manifest says {entry.size} ({how})")
        else:
            same_size[rel] = present[rel]
    problems += [
        f"{rel}: not in the manifest (added after the commit)"
        for rel in present
        if rel not in manifest.files
    ]
    if deep:
        for rel, entry in _hash_all(same_size, fsync=False).items():
            if entry != manifest.files[rel]:
                problems.append(f"{rel}: sha256 differs from the manifest (corrupt)")
    return manifest, problems


def status_of(ckpt_dir: Path, problems: builtins.list[str]) -> Status:
    """ok, or corrupt (committed, files changed since), or partial (never committed)."""
    ckpt_dir = Path(ckpt_dir)
    if TMP_DIR_RE.fullmatch(ckpt_dir.name) or not (ckpt_dir / MANIFEST).exists():
        return "partial"
    return "corrupt" if problems else "ok"


# ---- the store ----


@dataclass
class CheckpointStore:
    """``RUN_DIR/checkpoints``. One instance per run writes (see the module docstring); any number read."""

    root: Path
    keep_last: int = 3
    _pending: set[Path] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")

    # -- writing --

    def begin(self, step: int) -> PendingCheckpoint:
        """A fresh temporary directory for step ``step``; removes debris of earlier sessions first."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.recover()
        path = Path(file_modes.mkdtemp(prefix=f".{step_dir_name(step)}.tmp-", dir=self.root))
        self._pending.add(path)
        return PendingCheckpoint(step, path)

    def recover(self) -> builtins.list[Path]:
        """Remove every ``.tmp-``/``.trash-`` entry not created by this store: half-written checkpoints and
        half-deleted ones of a crashed session. Returns what was removed."""
        removed = []
        if not self.root.is_dir():
            return removed
        for p in sorted(self.root.iterdir()):
            if _DEBRIS.fullmatch(p.name) and p not in self._pending:
                what = "a partial write" if TMP_DIR_RE.fullmatch(p.name) else "left over"
                log.warning(
                    "checkpoint store %s: removing %s (%s, from an earlier session)",
                    self.root,
                    p.name,
                    what,
                )
                _remove(p)
                removed.append(p)
        return removed

    def commit(self, pending: PendingCheckpoint, meta: dict[str, Any] | None = None) -> Checkpoint:
        """Seal ``pending``: manifest, rename to ``step_N``, point ``latest`` at it, prune. Called by one
        process after every writer finished."""
        if pending.path not in self._pending:
            raise CheckpointStorageError(
                f"{pending.path}: not a pending checkpoint of this store (already committed, "
                "aborted, or begun by another store)"
            )
        src = pending.path
        if (src / MANIFEST).exists():
            raise CheckpointStorageError(
                f"{src}: writers must not create {MANIFEST} (reserved for the commit)"
            )
        meta = dict(meta or {})
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise CheckpointStorageError(f"checkpoint meta must be JSON: {e}") from e
        files = _hash_all(_files(src), fsync=True)
        for dirpath, _, _ in os.walk(src, topdown=False):
            fsync_dir(Path(dirpath))
        manifest = Manifest(pending.step, time.time(), meta, files)
        atomic_write_bytes(
            src / MANIFEST, (json.dumps(manifest.to_json(), indent=1) + "\n").encode()
        )

        name = step_dir_name(pending.step)
        target = self.root / name
        replaced = self._to_trash(target) if target.exists() else None
        try:
            os.rename(src, target)
        except BaseException:
            if replaced is not None:
                os.rename(replaced, target)
            raise
        self._pending.discard(src)
        fsync_dir(self.root)
        atomic_write_bytes(self.root / LATEST, f"{name}\n".encode())
        if replaced is not None:
            log.warning("checkpoint store %s: replaced the earlier %s", self.root, name)
            _remove(replaced)
        self._prune(pending.step)
        return Checkpoint(pending.step, target, manifest)

    def abort(self, pending: PendingCheckpoint) -> None:
        """Give up a pending checkpoint (a failed save): its directory is deleted."""
        self._pending.discard(pending.path)
        _remove(pending.path)

    def _to_trash(self, path: Path) -> Path:
        trash = self.root / f".{path.name}.trash-{secrets.token_hex(4)}"
        os.rename(path, trash)
        return trash

    def _prune(self, committed: int) -> None:
        complete = [c for c in self._step_dirs() if (c[1] / MANIFEST).exists()]
        newer = [(s, p) for s, p in complete if s > committed]
        older = sorted((c for c in complete if c[0] < committed), reverse=True)
        doomed = [
            (
                p,
                f"from a trajectory the run left (it resumed before step {s} and committed step {committed})",
            )
            for s, p in newer
        ]
        doomed += [(p, f"keep_last={self.keep_last}") for _, p in older[self.keep_last - 1 :]]
        for path, why in doomed:
            log.info("checkpoint store %s: deleting %s (%s)", self.root, path.name, why)
            _remove(self._to_trash(path))

    # -- reading --

    def _step_dirs(self) -> builtins.list[tuple[int, Path]]:
        """(step, path) of every ``step_N`` directory, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := STEP_DIR_RE.fullmatch(p.name)) and p.is_dir()
        ]
        return sorted(found)

    def latest_step(self) -> int | None:
        """The step ``latest`` names (the last commit), or None when there is no readable pointer."""
        try:
            text = (self.root / LATEST).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        m = STEP_DIR_RE.fullmatch(text)
        if not m:
            log.warning(
                "checkpoint store %s: %s holds %r, not a step directory name",
                self.root,
                LATEST,
                text[:80],
            )
            return None
        return int(m.group(1))

    def list(self) -> builtins.list[Checkpoint]:
        """Committed checkpoints (readable manifest), oldest first; files not verified."""
        out = []
        for step, path in self._step_dirs():
            try:
                out.append(Checkpoint(step, path, Manifest.read(path)))
            except (FileNotFoundError, CheckpointStorageError):
                continue
        return out

    def get(self, step: int) -> Checkpoint:
        path = self.root / step_dir_name(step)
        try:
            return Checkpoint(step, path, Manifest.read(path))
        except FileNotFoundError:
            have = [s for s, _ in self._step_dirs()]
            raise CheckpointStorageError(
                f"no committed checkpoint for step {step} in {self.root} "
                f"(steps there: {have or 'none'})"
            ) from None

    def verify(self, step: int, deep: bool = True) -> builtins.list[str]:
        """Problems with checkpoint ``step`` (empty: good). Shallow (``deep=False``): file set and sizes."""
        path = self.root / step_dir_name(step)
        if not path.is_dir():
            return [f"{path.name}: no such checkpoint in {self.root}"]
        return check_dir(path, deep=deep)[1]

    def latest_good(self, deep: bool = False) -> Checkpoint | None:
        """The newest checkpoint whose files match its manifest (sizes; sha256 too when ``deep``), or None.
        Every newer one skipped is logged with its problems."""
        pointer = self.latest_step()
        dirs = self._step_dirs()
        if pointer is not None and pointer not in {s for s, _ in dirs}:
            log.warning(
                "checkpoint store %s: %s names %s, which does not exist",
                self.root,
                LATEST,
                step_dir_name(pointer),
            )
        for p in self._partials():
            log.warning(
                "checkpoint store %s: ignoring %s (a write that never committed)", self.root, p.name
            )
        for step, path in reversed(dirs):
            manifest, problems = check_dir(path, deep=deep)
            if manifest is not None and not problems:
                if pointer is not None and step != pointer:
                    log.warning(
                        "checkpoint store %s: using %s although %s names %s",
                        self.root,
                        path.name,
                        LATEST,
                        step_dir_name(pointer),
                    )
                return Checkpoint(step, path, manifest)
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            log.warning(
                "checkpoint store %s: skipping %s: %s%s",
                self.root,
                path.name,
                "; ".join(problems[:3]),
                more,
            )
        return None

    def _partials(self) -> builtins.list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if TMP_DIR_RE.fullmatch(p.name) and p not in self._pending
        )

    def statuses(self, deep: bool = False) -> builtins.list[CheckpointStatus]:
        """Every committed, corrupt or partial checkpoint directory, by step (partials after commits of the
        same step)."""
        rows = []
        for step, path in self._step_dirs():
            manifest, problems = check_dir(path, deep=deep)
            rows.append(
                CheckpointStatus(
                    path.name, step, path, status_of(path, problems), tuple(problems), manifest
                )
            )
        for path in self._partials():
            step = int(TMP_DIR_RE.fullmatch(path.name).group(1))  # type: ignore[union-attr]
            rows.append(
                CheckpointStatus(
                    path.name,
                    step,
                    path,
                    "partial",
                    ("never committed (being written, or a crashed write)",),
                    None,
                )
            )
        return sorted(rows, key=lambda r: (r.step, r.name.startswith(".")))


def _remove(path: Path) -> None:
    """Delete a file or directory tree; what cannot be deleted now (a busy file on NFS) stays for later."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not delete %s (%s); a later begin()/recover() retries", path, e)


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"
