"""What ``rollhpc ckpt list|inspect|verify`` print: lines of text built from ``storage``, read-only.

``rollhpc status`` imports it on the login node: torch loads only when ``inspect`` reads a tensor file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rollhpc.checkpoint.optimizer_report import optimizer_lines
from rollhpc.checkpoint.storage import (
    MANIFEST,
    STEP_DIR_RE,
    TMP_DIR_RE,
    CheckpointStatus,
    CheckpointStorageError,
    CheckpointStore,
    check_dir,
    human_bytes,
    status_of,
    step_dir_name,
)
from rollhpc.rundir import RunPaths

_MAX_TENSORS = 20  # per file, in `inspect`


def open_path(path: Path) -> tuple[CheckpointStore, Path | None]:
    """A run directory, a checkpoints/ folder or one checkpoint directory -> (store, that checkpoint or None)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointStorageError(f"{path}: no such directory")
    if RunPaths(path).checkpoints.is_dir():
        return CheckpointStore(RunPaths(path).checkpoints), None
    if (
        (path / MANIFEST).exists()
        or STEP_DIR_RE.fullmatch(path.name)
        or TMP_DIR_RE.fullmatch(path.name)
    ):
        return CheckpointStore(path.parent), path
    return CheckpointStore(path), None


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _disk_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _checked(deep: bool) -> str:
    return "sizes and sha256 checked" if deep else "sizes checked; --deep also checks sha256"


def resume_choice(rows: list[CheckpointStatus]) -> CheckpointStatus | None:
    """The row ``CheckpointStore.latest_good`` would pick."""
    return next((r for r in reversed(rows) if r.status == "ok"), None)


def list_lines(store: CheckpointStore, deep: bool) -> list[str]:
    rows = store.statuses(deep=deep)
    if not rows:
        return [f"no checkpoints in {store.root}"]
    pointer = store.latest_step()
    table = [("STEP", "NAME", "WRITTEN", "SIZE", "FILES", "STATUS", "")]
    notes: dict[int, str] = {}
    for i, r in enumerate(rows):
        if r.manifest is not None:
            written, size, files = (
                _when(r.manifest.created),
                r.manifest.nbytes,
                len(r.manifest.files),
            )
        else:
            (files, size), written = _disk_bytes(r.path), "-"
        latest = "latest" if pointer == r.step and r.name == step_dir_name(r.step) else ""
        table.append(
            (str(r.step), r.name, written, human_bytes(size), str(files), r.status, latest)
        )
        if r.name.startswith("."):
            notes[i + 1] = (
                "    (never committed: being written, or left by a crash; ignored on resume)"
            )
        elif r.status != "ok":
            more = f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else ""
            notes[i + 1] = f"    ! {r.problems[0]}{more}"
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = [f"checkpoints in {store.root}"]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i in notes:
            lines.append(notes[i])
    choice = resume_choice([r for r in rows if not r.name.startswith(".")])
    named = step_dir_name(pointer) if pointer is not None else "nothing"
    lines.append(
        f"latest names {named}; a resume would use {choice.name if choice else 'nothing (no good checkpoint)'} "
        f"({_checked(deep)})"
    )
    return lines


def verify_lines(path: Path, deep: bool) -> tuple[bool, list[str]]:
    """(good, lines): one line per problem, or one ``ok:`` line."""
    store, ckpt = open_path(path)
    if ckpt is not None:
        manifest, problems = check_dir(ckpt, deep=deep)
        if problems:
            return False, [f"{ckpt.name}: {p}" for p in problems]
        assert manifest is not None
        return True, [
            f"ok: {ckpt.name} ({len(manifest.files)} files, {human_bytes(manifest.nbytes)}; {_checked(deep)})"
        ]
    rows = [r for r in store.statuses(deep=deep) if not r.name.startswith(".")]
    if not rows:
        return False, [f"{store.root}: no checkpoints"]
    problems = [f"{r.name}: {p}" for r in rows for p in r.problems]
    pointer = store.latest_step()
    if pointer is None:
        problems.append(f"latest: missing or unreadable in {store.root}")
    elif pointer not in {r.step for r in rows}:
        problems.append(f"latest: names {step_dir_name(pointer)}, which does not exist")
    if problems:
        return False, problems
    return True, [
        f"ok: {len(rows)} checkpoint(s) ({rows[0].name} .. {rows[-1].name}), latest {step_dir_name(pointer)}; "
        f"{_checked(deep)}"
    ]


def inspect_lines(path: Path, max_files: int) -> list[str]:
    store, ckpt = open_path(path)
    lines = []
    if ckpt is None:
        pointer = store.latest_step()
        steps = [c.step for c in store.list()]
        if pointer is not None and (store.root / step_dir_name(pointer)).is_dir():
            ckpt, why = store.root / step_dir_name(pointer), "the one latest names"
        elif steps:
            ckpt, why = store.root / step_dir_name(steps[-1]), "the newest; latest names none"
        else:
            return [f"no checkpoints in {store.root}"]
        lines.append(f"(showing {ckpt.name}, {why}; pass a checkpoint directory to see another)")
    manifest, problems = check_dir(ckpt, deep=False)
    lines.append(f"checkpoint {ckpt.resolve()}")
    on_disk = {
        p.relative_to(ckpt).as_posix(): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()
    }
    on_disk.pop(MANIFEST, None)
    status = status_of(ckpt, problems)
    if manifest is not None:
        lines.append(
            f"step {manifest.step}, written {_when(manifest.created)}, {len(manifest.files)} files, "
            f"{human_bytes(manifest.nbytes)}; status {status} (sizes checked; `rollhpc ckpt verify --deep` "
            "checks sha256)"
        )
    else:
        lines.append(
            f"{len(on_disk)} files, {human_bytes(sum(on_disk.values()))} on disk; status {status}"
        )
    lines += [f"  ! {p}" for p in problems]
    if manifest is not None:
        lines.append("meta:" if manifest.meta else "meta: (none)")
        lines += (
            ["  " + line for line in json.dumps(manifest.meta, indent=2).splitlines()]
            if manifest.meta
            else []
        )
    lines += optimizer_lines(ckpt)
    sizes = sorted(on_disk.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = sizes if max_files <= 0 else sizes[:max_files]
    lines.append(f"files, largest first ({len(shown)} of {len(sizes)}):")
    lines += [f"  {human_bytes(n):>10}  {rel}" for rel, n in shown]
    tensor_lines = []
    for rel in sorted(on_disk):
        if rel.endswith((".safetensors", ".pt", ".pth")):
            head, body = _tensors(ckpt / rel)
            tensor_lines += [f"  {rel}: {head}", *(f"    {t}" for t in body)]
    if tensor_lines:
        lines.append("tensors:")
        lines += tensor_lines
    return lines


def _tensors(path: Path) -> tuple[str, list[str]]:
    """(summary, one line per tensor) of a .safetensors (header only) or .pt file (memory-mapped)."""
    import torch

    found: list[tuple[str, Any, tuple[int, ...]]] = []
    if path.suffix == ".safetensors":
        from rollhpc.checkpoint.safetensors_io import SafetensorsError, read_header

        try:
            found = [(name, info.dtype, info.shape) for name, info in read_header(path).items()]
        except SafetensorsError as e:
            return f"unreadable ({e})", []
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 -- any failure to read is reported, not raised
            return f"not readable as tensors only ({type(e).__name__})", []
        _walk(obj, "", found)
    body = [
        f"{name}  {str(dtype).removeprefix('torch.')}  {list(shape)}"
        for name, dtype, shape in found[:_MAX_TENSORS]
    ]
    if len(found) > _MAX_TENSORS:
        body.append(f"... and {len(found) - _MAX_TENSORS} more")
    return f"{len(found)} tensor(s)", body


def _walk(obj: object, prefix: str, out: list[tuple[str, Any, tuple[int, ...]]]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out.append((prefix or "(tensor)", obj.dtype, tuple(obj.shape)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), out)
