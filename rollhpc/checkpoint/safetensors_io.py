"""Hugging Face safetensors directories, read and written one tensor at a time.

The safetensors format is an 8-byte little-endian header length, a JSON header (``name -> dtype, shape,
data_offsets``, optional ``__metadata__``) and the raw little-endian tensor bytes. Reading a tensor here
is one ``seek`` + ``readinto`` of exactly its bytes (no memory map, whose touched pages would stay in
the resident set until the file is closed); writing plans every file's header first (names, dtypes,
shapes are known before any data), then streams each tensor's bytes in plan order, so neither direction
holds more than the tensor in hand. Directories: ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (Hugging Face's layout).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    """A missing, truncated or malformed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{path}: truncated ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise SafetensorsError(
                    f"{path}: header of {n} bytes exceeds the file ({size} bytes): truncated or not "
                    "a safetensors file"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise SafetensorsError(f"{path}: {e}") from e
    except ValueError as e:
        if isinstance(e, SafetensorsError):
            raise
        raise SafetensorsError(f"{path}: malformed header ({e})") from e
    out, end = {}, 8 + n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise SafetensorsError(f"{path}: {name} has unsupported dtype {entry.get('dtype')!r}")
        b, e = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if e - b != dtype.itemsize * _numel(shape) or 8 + n + e > size:
            raise SafetensorsError(
                f"{path}: {name} ({entry['dtype']} {list(shape)}) does not fit its byte range "
                f"[{b}, {e}) in a file of {size} bytes: truncated or corrupt"
            )
        out[name] = TensorInfo(path, dtype, shape, 8 + n + b, e - b)
        end = max(end, 8 + n + e)
    if end != size:
        raise SafetensorsError(
            f"{path}: {size} bytes, the header describes {end}: truncated or corrupt"
        )
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF model directory (index or single file)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise SafetensorsError(f"{index}: unreadable index ({e})") from e
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise SafetensorsError(f"{model_dir}: index names missing file(s) {missing}")
        return [model_dir / n for n in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        hint = (
            " (only .bin weights: re-save with safe_serialization)"
            if any(model_dir.glob("*.bin"))
            else ""
        )
        raise SafetensorsError(f"{model_dir}: no safetensors weights{hint}")
    return found


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """An HF model directory's tensors as a read-only mapping; ``d[name]`` reads that tensor off disk
    (a fresh CPU tensor each time, nothing cached)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.files = weight_files(self.dir)
        self.info: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.info:
                    raise SafetensorsError(
                        f"{self.dir}: tensor {name} is in both {self.info[name].file.name} and "
                        f"{path.name}"
                    )
                self.info[name] = info

    def __getitem__(self, name: str) -> torch.Tensor:
        info = self.info[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        buf = bytearray(info.nbytes)
        with open(info.file, "rb") as f:
            f.seek(info.start)
            if f.readinto(buf) != info.nbytes:
                raise SafetensorsError(f"{info.file}: truncated while reading {name}")
        return torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype).reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.info)

    def __len__(self) -> int:
        return len(self.info)

    def largest_file(self) -> tuple[Path, int]:
        path = max(self.files, key=lambda p: p.stat().st_size)
        return path, path.stat().st_size


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * _numel(self.shape)


def plan_files(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split ``tensors`` (in order) into files of at most ``max_shard_bytes`` (a larger tensor gets a
    file of its own), as ``save_pretrained`` shards."""
    files: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


class SafetensorsWriter:
    """Writes an HF weights directory from tensors given one at a time, in the order of ``tensors``.
    Headers are written up front; ``close()`` checks that every planned tensor came and writes the
    index (for more than one file)."""

    def __init__(
        self,
        out_dir: Path,
        tensors: list[PlannedTensor],
        max_shard_bytes: int,
        metadata: Mapping[str, str] | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.files = plan_files(tensors, max_shard_bytes)
        n = len(self.files)
        self.names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.order = [(i, t) for i, f in enumerate(self.files) for t in f]
        self.metadata = {"format": "pt", **dict(metadata or {})}
        self._next = 0
        self._fh: BinaryIO | None = None
        self._open_index = -1

    def _open(self, i: int) -> None:
        if self._fh is not None:
            self._fh.close()
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for t in self.files[i]:
            header[t.name] = {
                "dtype": _NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._fh = open(self.out_dir / self.names[i], "wb")
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._open_index = i

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.order):
            raise ValueError(f"{name}: more tensors than planned")
        i, planned = self.order[self._next]
        if (
            name != planned.name
            or tensor.dtype != planned.dtype
            or tuple(tensor.shape) != planned.shape
        ):
            raise ValueError(
                f"expected {planned.name} {planned.dtype} {list(planned.shape)} next, got {name} "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        if i != self._open_index:
            self._open(i)
        if planned.nbytes:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            self._fh.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> list[Path]:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._next != len(self.order):
            left = [t.name for _, t in self.order[self._next :]]
            raise ValueError(f"{len(left)} planned tensor(s) never written: {left[:5]}")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": sum(t.nbytes for _, t in self.order)},
                "weight_map": {t.name: self.names[i] for i, t in self.order},
            }
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return [self.out_dir / n for n in self.names]
