"""Trainer -> generators weight sync over a process group of their own (gloo on CPU, NCCL on GPU).

Why a separate group: the trainer's torch.distributed world holds only the train role, and each vLLM
engine has its own; the sync needs trainer rank 0 plus one rank per generator. A ``TCPStore`` hosted by
the trainer (ephemeral port, published through the controller) and a standalone ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` give exactly that, without touching either side's default group. Weights then go
straight from the trainer to every generator in one broadcast per bucket: no controller hop, and on GPU
no host copy at all.

Wire format, per bucket: a header (int64 length, then the pickled ``(names, shapes, offsets, dtype,
numel, checksums)``), then the bucket's flat data; an empty header ends the stream. ``checksums`` (per tensor,
``buckets.stamp``) travel on a verified sync and the receiver checks them before anything is loaded.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from rollhpc.testing import fault_injection
from rollhpc.weight_sync.buckets import Bucket, stamp, verified

__all__ = ["WeightBroadcast", "open_store"]


def open_store(timeout_s: float = 600.0) -> Any:
    """The rendezvous store on the sender (rank 0), on an ephemeral port; ``store.port`` is the port."""
    import torch.distributed as dist

    return dist.TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class WeightBroadcast:
    """One end of the channel. Rank 0 sends (``send``), ranks 1..world-1 receive (``receive``)."""

    def __init__(self, rank: int, world: int, host: str, port: int, *, store: Any = None,
                 device: torch.device | None = None, timeout_s: float = 600.0):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, None, False, timeout=timeout)
        prefixed = dist.PrefixStore("rollhpc-weights", store)
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world, dist.ProcessGroupNCCL.Options())
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        self.bytes_sent = 0
        self.syncs = 0  # sends (rank 0) or receives so far

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.group.broadcast([t], opts).wait()
        return t

    def _header(self, meta: Any | None) -> Any:
        if self.rank == 0:
            raw = pickle.dumps(meta) if meta is not None else b""
            n = self._broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
            if raw:
                self._broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device))
            return meta
        n = int(self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device)).item())
        if n == 0:
            return None
        raw = self._broadcast(torch.empty(n, dtype=torch.uint8, device=self.device))
        return pickle.loads(raw.cpu().numpy().tobytes())

    def send(self, buckets: Iterable[Bucket], verify: bool = False) -> int:
        """Broadcast every bucket, then the end marker; returns the bytes sent. ``verify``: each tensor's
        checksum goes with it, for the receivers to check."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends weights")
        sent = 0
        self.syncs += 1
        for i, b in enumerate(buckets):
            b.data = b.data.to(self.device).contiguous()
            if verify:
                stamp(b)
            fault_injection.corrupt_weight_sync(self.syncs, i, b.data)
            self._header((b.names, b.shapes, b.offsets, b.data.dtype, b.data.numel(), b.checksums))
            if i == 0:
                fault_injection.in_weight_sync(self.syncs)
            self._broadcast(b.data)
            sent += b.nbytes
        self._header(None)
        self.bytes_sent += sent
        return sent

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every weight sent, bucket by bucket, until the end marker."""
        if self.rank == 0:
            raise RuntimeError("rank 0 is the sender")
        self.syncs += 1
        while (meta := self._header(None)) is not None:
            names, shapes, offsets, dtype, numel, checksums = meta
            data = self._broadcast(torch.empty(numel, dtype=dtype, device=self.device))
            yield from verified(Bucket(data, list(names), list(shapes), list(offsets), checksums), self.syncs)
