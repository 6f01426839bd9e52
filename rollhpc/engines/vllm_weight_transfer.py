"""Weight updates for a vLLM engine whose tensor-parallel ranks are processes of their own (TP > 1).

With TP = 1 vLLM's worker runs in the generator's process and reads the new weights as live tensors. With
TP > 1 each TP rank is a worker process that vLLM starts. Handing those workers the weights as arguments of
``collective_rpc("reload_weights")`` pickles the whole model into vLLM's message queue (through a socket
above 24 MiB), and every worker unpickles a private copy of all of it before its weight loader keeps its
own shard.

vLLM's own answer is its weight-transfer engines (``vllm.distributed.weight_transfer``): on every worker an
update is ``start_weight_update`` (layerwise reload begins), ``update_weights(info)`` once per chunk, and
``finish_weight_update`` (each layer is processed again, as after a load from disk). Only the small ``info``
travels through the RPC queue; the bytes take the backend's own way. This module drives that protocol:

- **CPU** (``rollhpc_shm``, a backend of ours: vLLM ships none for CPU): each chunk is written once into a
  file in /dev/shm; every worker maps the file and loads views of it, so its weight loader copies only
  its own shard out of the shared pages.
- **GPU** (vLLM's ``ipc`` backend, packed): chunks are packed into a buffer on each TP worker's GPU, which the
  worker maps through a CUDA IPC handle and copies from device to device. Untested on a GPU: the GPU machines
  the tests run on carry no CUDA build of vLLM.

Measured on CPU (bench/vllm_tp_weight_update.py, TP=2, the Qwen2.5-0.5B shape in bfloat16): see
bench/results/vllm_tp_weight_update.json, shm beside the pickled path.

The ``rollhpc_shm`` backend must be known in every vLLM process, the workers included; vLLM loads the
``vllm.general_plugins`` entry points in each, and ours (pyproject.toml) calls ``register``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.plugins import load_general_plugins

log = logging.getLogger(__name__)

SHM_BACKEND = "rollhpc_shm"
# byte alignment of each tensor in a chunk: any dtype can be viewed at any tensor's offset
ALIGN = 64


# -- both sides: a chunk as the workers get it (their engine: vllm_shm_receiver) ------------------


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to set up: every chunk names its own file."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the file holding its bytes, and each tensor's name, dtype, shape and byte offset in it."""

    path: str
    nbytes: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]

    def __post_init__(self) -> None:
        n = len(self.names)
        if not len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n:
            raise ValueError(f"a chunk of {n} names needs as many dtypes, shapes and offsets")


def _views(data: torch.Tensor, info: ShmUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype_name, shape, offset in zip(
        info.names, info.dtype_names, info.shapes, info.offsets
    ):
        dtype = getattr(torch, dtype_name)
        n = dtype.itemsize
        for d in shape:
            n *= d
        yield name, data[offset : offset + n].view(dtype).view(shape)


def register() -> None:
    """vLLM plugin hook (``vllm.general_plugins``): make ``rollhpc_shm`` a weight-transfer backend in this
    process, its engine (``vllm_shm_receiver``) imported where vLLM builds one, on a worker. vLLM may call it
    more than once per process."""
    if SHM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            SHM_BACKEND, "rollhpc.engines.vllm_shm_receiver", "ShmWeightTransferEngine"
        )


def shm_backend_registered() -> bool:
    """Whether the worker processes will know ``rollhpc_shm``: vLLM loads the same plugins in them as here
    (the entry point is missing where rollhpc is on PYTHONPATH without being installed, or when
    ``VLLM_PLUGINS`` leaves it out)."""
    load_general_plugins()
    return SHM_BACKEND in WeightTransferEngineFactory._registry


# -- generator side -------------------------------------------------------------------------------------------


def backend_for(on_cpu: bool) -> str:
    """The weight-transfer backend a TP > 1 engine is started with."""
    return SHM_BACKEND if on_cpu else "ipc"


def init_info(backend: str) -> dict[str, Any]:
    """What ``init_weight_transfer_engine`` gets once after the engine starts."""
    return {} if backend == SHM_BACKEND else {"packed": True}


def chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int, align: int = ALIGN
) -> Iterator[list[tuple[str, torch.Tensor, int]]]:
    """Tensors grouped in order into chunks of at most ``chunk_bytes`` (a larger tensor is a chunk of its own),
    each with its byte offset in the chunk, a multiple of ``align``. Lazy: one chunk's tensors held at a time."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunk: list[tuple[str, torch.Tensor, int]] = []
    end = 0
    for name, tensor in named_tensors:
        t = tensor.detach()
        offset = -(-end // align) * align
        if chunk and offset + t.nbytes > chunk_bytes:
            yield chunk
            chunk, offset = [], 0
        chunk.append((name, t, offset))
        end = offset + t.nbytes
    if chunk:
        yield chunk


def chunk_nbytes(chunk: list[tuple[str, torch.Tensor, int]]) -> int:
    _, last, offset = chunk[-1]
    return max(offset + last.nbytes, 1)


def _pack(chunk: list[tuple[str, torch.Tensor, int]], into: torch.Tensor) -> dict[str, Any]:
    """Copy a chunk's tensors into the uint8 buffer ``into`` at their offsets; the chunk's description."""
    for (
        _,
        t,
        offset,
    ) in chunk:  # as bytes: a packed chunk's offsets need not suit the tensor's dtype
        into[offset : offset + t.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
    return {
        "names": [n for n, _, _ in chunk],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t, _ in chunk],
        "shapes": [list(t.shape) for _, t, _ in chunk],
    }


def shm_dir() -> str:
    """Where chunk files go: /dev/shm (memory) where it exists."""
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else tempfile.gettempdir()
    )


def _shm_chunk(chunk: list[tuple[str, torch.Tensor, int]]) -> ShmUpdateInfo:
    """Write one chunk into a new file in shared memory; the caller unlinks ``info.path``."""
    nbytes = chunk_nbytes(chunk)
    fd, path = tempfile.mkstemp(prefix="rollhpc-weights-", dir=shm_dir())
    try:
        os.ftruncate(fd, nbytes)
        data = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return ShmUpdateInfo(
            path=path, nbytes=nbytes, offsets=[o for _, _, o in chunk], **_pack(chunk, data)
        )
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def send_shm(
    collective_rpc: Callable[..., object],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    chunk_bytes: int,
) -> int:
    """One ``rollhpc_shm`` update through ``collective_rpc`` (the engine's): returns the bytes sent.

    Every chunk gets a new file, unlinked as soon as the workers have loaded it (their mappings outlive the name),
    so no file is ever written while a worker may still read it, and a process killed mid-update leaves at most
    one chunk behind in /dev/shm. (Reusing files across updates would spare the page faults of new pages, most of
    the copy's time here, but any weight vLLM kept as a view of its input would then change under it.)
    Writing chunk k+1 while the workers load chunk k gains nothing (measured with the workers and this process on
    two cores)."""
    sent = 0
    collective_rpc("start_weight_update")
    for chunk in chunks(named_tensors, chunk_bytes):
        info = _shm_chunk(chunk)
        try:
            collective_rpc("update_weights", args=(asdict(info),))
        finally:
            os.unlink(info.path)
        sent += info.nbytes
    collective_rpc("finish_weight_update")
    return sent


def send_cuda_ipc(
    collective_rpc: Callable[..., object],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    chunk_bytes: int,
    tensor_parallel_size: int,
) -> int:
    """One update through vLLM's packed ``ipc`` backend; returns the bytes sent. Untested on a GPU.

    vLLM's IPC consumer maps the handle of its own GPU (handles are keyed by GPU UUID), so each TP worker's GPU
    gets a buffer of its own: TP worker i runs on this process's ``cuda:i`` (vLLM starts its workers over the
    devices this process sees). Each chunk is packed on ``cuda:0`` and copied device to device to the others;
    the buffers are exported once and refilled chunk after chunk, which is safe because each ``update_weights``
    returns after the workers have cloned the chunk and synchronized (a larger tensor gets larger buffers)."""
    devices = list(range(tensor_parallel_size))
    buffers: list[torch.Tensor] = []
    handles: dict[str, tuple] = {}
    sent = 0
    collective_rpc("start_weight_update")
    # vLLM's consumer splits the chunk back to back
    for chunk in chunks(named_tensors, chunk_bytes, align=1):
        nbytes = chunk_nbytes(chunk)
        if not buffers or nbytes > buffers[0].numel():
            buffers = [
                torch.empty(max(nbytes, chunk_bytes), dtype=torch.uint8, device=d) for d in devices
            ]
            handles = {
                str(torch.cuda.get_device_properties(d).uuid): reduce_tensor(b)[1]
                for d, b in zip(devices, buffers)
            }
        info = _pack([(n, t.to(buffers[0].device), o) for n, t, o in chunk], buffers[0])
        info["tensor_sizes"] = [t.nbytes for _, t, _ in chunk]
        for b in buffers[1:]:
            b[:nbytes].copy_(buffers[0][:nbytes])
        for d in devices:
            torch.cuda.synchronize(d)  # every buffer written before any worker reads
        collective_rpc("update_weights", args=({**info, "ipc_handles": handles},))
        sent += nbytes
    collective_rpc("finish_weight_update")
    return sent
