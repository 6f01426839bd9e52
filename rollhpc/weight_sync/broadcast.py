"""Trainer -> generators weight sync over a process group of their own (gloo on CPU, NCCL on GPU).

Why a separate group: the trainer's torch.distributed world holds only the train role, and each vLLM
engine has its own; the sync needs trainer rank 0 plus one rank per generator. A ``TCPStore`` hosted by
the trainer (ephemeral port, published through the controller) and a standalone ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` give exactly that, without touching either side's default group. Weights then go
straight from the trainer to every generator in one broadcast per bucket: no controller hop, and on GPU
no host copy at all.

Wire format, per bucket: a header (int64 length, then the pickled ``(entries, nbytes, checksums)``: each
tensor's name, dtype, shape and byte offset, ``slots.Entry``), then the bucket's bytes (mixed dtypes, each tensor
at an aligned offset); an empty header ends the stream. ``checksums`` (per tensor, ``buckets.tensor_checksum``)
travel on a verified sync and the receiver checks them before anything is loaded. Memory: the sender packs into
``IN_FLIGHT_BUCKETS`` reused slots (``send``), each receiver holds at most two buckets (``receive``).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from rollhpc.testing import fault_injection
from rollhpc.weight_sync.buckets import IN_FLIGHT_BUCKETS, check_tensor, tensor_checksum
from rollhpc.weight_sync.slots import Entry, fill_slots, unpack_entries

__all__ = ["WeightBroadcast", "open_store"]


# A bucket's header: its tensors' places, its size, their checksums on a verified sync
_Header = tuple[list[Entry], int, list[int] | None]


def open_store(timeout_s: float = 600.0) -> dist.TCPStore:
    """The rendezvous store on the sender (rank 0), on an ephemeral port; ``store.port`` is the port."""
    return dist.TCPStore(
        "0.0.0.0", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class WeightBroadcast:
    """One end of the channel. Rank 0 sends (``send``), ranks 1..world-1 receive (``receive``)."""

    def __init__(
        self,
        rank: int,
        world: int,
        host: str,
        port: int,
        *,
        store: dist.Store | None = None,
        device: torch.device | None = None,
        timeout_s: float = 600.0,
    ):
        self.rank, self.world = rank, world
        self.device = device or (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, None, False, timeout=timeout)
        prefixed = dist.PrefixStore("rollhpc-weights", store)
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(
                prefixed, rank, world, dist.ProcessGroupNCCL.Options()
            )
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        self.bytes_sent = 0
        self.syncs = 0  # sends (rank 0) or receives so far

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self._broadcast_async(t).wait()
        return t

    def _broadcast_async(self, t: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.group.broadcast([t], opts)

    def _header(self, meta: _Header | None) -> _Header | None:
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

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int = 64 << 20,
        verify: bool = False,
    ) -> int:
        """Broadcast every tensor, bucket by bucket, then the end marker; returns the bytes sent. ``verify``: each
        tensor's checksum goes with it, for the receivers to check.

        The buckets go through ``IN_FLIGHT_BUCKETS`` reused slots (``slots.fill_slots``): bucket ``i + 1`` is packed
        into the other slot while bucket ``i``'s broadcast runs (asynchronous on NCCL), and a slot is refilled only
        once its broadcast is done (``work.wait()``: on NCCL it orders this stream after it). The sender's extra
        memory is two slots, whatever the model's size."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends weights")
        self.syncs += 1
        slots: dict[int, torch.Tensor] = {}
        works: dict[int, dist.Work] = {}

        def open_slot(index: int, capacity: int) -> torch.Tensor:
            s = index % IN_FLIGHT_BUCKETS
            if s in works:
                works.pop(s).wait()
            if s not in slots or slots[s].numel() != capacity:
                slots.pop(s, None)
                slots[s] = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            return slots[s]

        sent = 0
        for b in fill_slots(named, bucket_bytes, open_slot):
            if verify:
                b.checksums = [tensor_checksum(t) for _, t in unpack_entries(b.data, b.entries)]
            fault_injection.corrupt_weight_sync(self.syncs, b.index, b.data)
            self._header((b.entries, b.data.numel(), b.checksums))
            if b.index == 0:
                fault_injection.in_weight_sync(self.syncs)
            works[b.slot] = self._broadcast_async(b.data)
            sent += b.data.numel()
        for w in works.values():
            w.wait()
        self._header(None)
        self.bytes_sent += sent
        return sent

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every weight sent, bucket by bucket, until the end marker. Each bucket lands in a
        tensor of its own (the engine may keep a view, as a tied embedding's head does), so the receiver holds the
        bucket it hands on and the one arriving: two."""
        if self.rank == 0:
            raise RuntimeError("rank 0 is the sender")
        self.syncs += 1
        while (meta := self._header(None)) is not None:
            entries, nbytes, checksums = meta
            data = self._broadcast(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
            tensors = unpack_entries(data, entries)
            if checksums is not None:
                for (name, t), want in zip(tensors, checksums):
                    check_tensor(name, t, want, self.syncs)
            del data
            yield from tensors
            del tensors
