"""Stream a model from one sender to a few receivers on its host through ``IN_FLIGHT_BUCKETS`` reused buffers.

Why: packing the whole model into buckets before any receiver reads them costs the model's size again on the
sender (a 30B MoE: ~57 GiB extra on the trainer's GPU, out of memory at the first sync). Here the sender holds
``IN_FLIGHT_BUCKETS`` (2) *slots* of ``slot_bytes`` each and reuses them:

1. the sender packs bucket ``i`` into slot ``i % 2`` tensor by tensor (each source tensor is dropped once copied,
   so a gathered tensor is alive only while it is copied), then posts its header (``SlotHeader``: the slot's
   handle, where each tensor lies, its checksums on a verified sync);
2. each receiver maps the slot (host slots once: later buckets in it reuse the mapping; GPU slots per bucket,
   ``CudaSlots.keep_mapped``), copies the bucket into
   memory of its own, checks the checksums, and acknowledges bucket ``i``; then it hands the tensors on (to the
   engine) while
3. the sender packs bucket ``i + 1`` into the other slot (overlapping the receivers' copy), and waits for every
   acknowledgement of bucket ``i + 1 - 2`` before it refills that slot; after the last bucket it posts an end
   marker, waits for every receiver to have let go of its mappings, and frees the slots.

A bucket is a byte range of mixed dtypes (each tensor at an aligned offset, its bytes copied verbatim): the
receiver's tensors are bit-identical. A tensor larger than ``slot_bytes`` gets a slot of its own size for its
bucket (the bound is then two of the largest tensor), and the slot shrinks back after it.

The headers and acknowledgements travel through the sender's ``TCPStore`` (the one the broadcast path already
hosts; keys under a per-sync prefix): a few hundred bytes per bucket, no process group to form, and it works
the same for GPU slots (``weight_sync.cuda_ipc``: CUDA IPC handles) and host slots (``weight_sync.shared_memory``:
files in /dev/shm). Errors stop both ends instead of hanging either: a receiver that fails (a checksum mismatch,
the engine raising) writes its error in place of its next acknowledgement; the sender then posts an abort
marker for the others and raises ``WeightSyncAborted`` naming that receiver; a sender that fails posts the abort
marker with its error. The controller then shows the first error that is not an abort (``driver.WeightSync``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollhpc.testing import fault_injection
from rollhpc.weight_sync.buckets import IN_FLIGHT_BUCKETS, check_tensor, tensor_checksum
from rollhpc.weight_sync.cuda_ipc import CudaSlots
from rollhpc.weight_sync.shared_memory import ShmSlots
from rollhpc.weight_sync.slot_memory import SlotHandle, SlotMemory

__all__ = [
    "Entry",
    "Filled",
    "PeakMeter",
    "SlotHeader",
    "SlotReceiver",
    "SlotSender",
    "StoreControl",
    "SyncStats",
    "WeightSyncAborted",
    "fill_slots",
    "slot_memory",
    "unpack_entries",
]

# bytes: every tensor starts at a multiple, so a byte slot can be viewed as any dtype there
ALIGN = 64


class WeightSyncAborted(RuntimeError):
    """This end stopped because the other end failed; that end's own error says why (it is the one to read)."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a bucket: its bytes at ``offset`` (a multiple of ``ALIGN``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class Filled:
    """A bucket packed into its slot: ``data`` is the slot's first ``nbytes`` (a view, no copy)."""

    index: int
    slot: int
    data: torch.Tensor  # uint8
    entries: list[Entry]
    checksums: list[int] | None = None


def _view(data: torch.Tensor, e: Entry) -> torch.Tensor:
    return data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)


def unpack_entries(data: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into a bucket's bytes (no copy)."""
    return [(e.name, _view(data, e)) for e in entries]


def fill_slots(
    named: Iterable[tuple[str, torch.Tensor]],
    slot_bytes: int,
    open_slot: Callable[[int, int], torch.Tensor],
) -> Iterator[Filled]:
    """Pack tensors (in order) into buckets of at most ``slot_bytes`` (``max(slot_bytes, its size)`` for a bucket
    whose first tensor is larger), copying each into the slot ``open_slot(index, capacity)`` gives (a uint8
    buffer of at least ``capacity`` bytes; the caller waits there until that slot may be refilled). Yields each
    bucket once full; the caller publishes it before asking for the next. Lazy: one source tensor at a time."""
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    index, buf, fill, entries = 0, None, 0, []
    for name, tensor in named:
        t = tensor.detach()
        size = t.numel() * t.element_size()
        start = -(-fill // ALIGN) * ALIGN
        if buf is not None and entries and start + size > buf.numel():
            yield Filled(index, index % IN_FLIGHT_BUCKETS, buf[:fill], entries)
            index, buf, fill, entries, start = index + 1, None, 0, [], 0
        if buf is None:
            buf = open_slot(index, max(slot_bytes, size))
        entry = Entry(name, t.dtype, tuple(t.shape), start)
        _view(buf, entry).copy_(t)
        entries.append(entry)
        fill = start + size
        del t, tensor  # a gathered tensor goes back to the allocator now, not with the next one
    if entries:
        yield Filled(index, index % IN_FLIGHT_BUCKETS, buf[:fill], entries)


@dataclass
class SlotHeader:
    """What a receiver needs for one bucket: which slot allocation (``slot_id``) and its handle, the bucket's size,
    its tensors and, on a verified sync, their checksums."""

    slot: int
    slot_id: str
    handle: SlotHandle
    nbytes: int
    entries: list[Entry]
    checksums: list[int] | None = None
    # the slots' memory: "cuda_ipc" or "shared_memory" (a receiver maps them accordingly)
    kind: str = ""


class StoreControl:
    """The headers and acknowledgements of one sync, as keys in the sender's TCPStore under ``tag`` (one per sync,
    so a stopped sync's leftovers never meet the next one): ``h<i>`` the i-th header (or end / abort marker),
    ``a<i>/<member>`` a receiver's acknowledgement of it (empty, or its error)."""

    def __init__(self, store: dist.Store, tag: str):
        self.store = dist.PrefixStore(f"rollhpc-slots/{tag}", store)

    def post(self, index: int, kind: str, body: SlotHeader | str | None = None) -> None:
        # also where a receiver looks when a slot it was told of is gone (``aborted``)
        if kind == "abort":
            self.store.set("abort", str(body).encode())
        self.store.set(f"h{index}", pickle.dumps((kind, body)))

    def aborted(self) -> str | None:
        """The sender's reason when it stopped this sync, else None (without waiting)."""
        return self.store.get("abort").decode() if self.store.check(["abort"]) else None

    def take(self, index: int) -> tuple[str, SlotHeader | str | None]:
        """The ``index``-th message, waiting for it (up to the store's timeout)."""
        return pickle.loads(self.store.get(f"h{index}"))

    def ack(self, index: int, member: int, error: str = "") -> None:
        self.store.set(f"a{index}/{member}", error.encode())

    def acks(self, index: int, members: int) -> list[tuple[int, str]]:
        """Wait for every member's acknowledgement of message ``index``; the ``(member, error)`` of those that
        failed. The keys are removed (the store stays small over a long run)."""
        keys = [f"a{index}/{m}" for m in range(members)]
        self.store.wait(keys)
        errors = [(m, self.store.get(k).decode()) for m, k in enumerate(keys)]
        for k in [f"h{index}", *keys]:
            self.store.delete_key(k)
        return [(m, e) for m, e in errors if e]


def connect_store(host: str, port: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """A client of the sender's TCPStore (a receiver's end of ``StoreControl``)."""
    return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))


def slot_memory(device: torch.device | str) -> SlotMemory:
    """Slots on ``device`` (or of a header's ``kind``): CUDA IPC on a GPU, shared-memory files on the CPU."""
    if str(device).startswith("cuda"):
        return CudaSlots(
            device if isinstance(device, torch.device) and device.index is not None else None
        )
    return ShmSlots()


class PeakMeter:
    """The sender's peak extra memory over a sync, measured: on a GPU the caching allocator's peak above what was
    allocated at the start (``torch.cuda.max_memory_allocated``, its peak reset first); on the CPU the process's
    resident high-water mark above its size at the start (VmHWM, reset through /proc/self/clear_refs), which
    counts the shared-memory slots' pages as they are written. None where it cannot be measured."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, None

    def __enter__(self) -> "PeakMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current resident size
                self.base = _status_kib("VmRSS") << 10
            except OSError:
                self.base = None
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def peak_extra(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return max((_status_kib("VmHWM") << 10) - self.base, 0)


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")


@dataclass
class SyncStats:
    """One streamed sync, as the sender saw it (``as_dict`` travels back to the controller)."""

    bytes: int = 0
    buckets: int = 0
    receivers: int = 0
    slot_bytes: int = 0  # the configured slot size (bucket_mb)
    # the most bytes of slots alive at once: at most IN_FLIGHT_BUCKETS slots
    peak_slot_bytes: int = 0
    # measured (PeakMeter): what the sync cost the sender at its peak
    peak_extra_bytes: int | None = None
    transport: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Slot:
    buf: torch.Tensor
    slot_id: str
    handle: SlotHandle
    first: int = 0  # the first bucket packed into it
    seen: bool = False  # every receiver has mapped it (acknowledged that bucket)


@dataclass
class SlotSender:
    """The sending end: ``memory`` makes the slots (``CudaSlots`` / ``ShmSlots``), ``control`` carries headers
    and acknowledgements to ``receivers`` receivers (members 0..receivers-1)."""

    memory: SlotMemory
    control: StoreControl
    receivers: int
    slot_bytes: int
    verify: bool = False
    sync: int = 0  # this sender's sync count (fault-injection hooks name syncs by it)
    stats: SyncStats = field(default_factory=SyncStats)
    _slots: dict[int, _Slot] = field(default_factory=dict)
    _acked: int = 0  # messages whose acknowledgements are all in
    _posted: int = 0  # messages posted (buckets, then the end marker)

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Stream every tensor through the slots, then the end marker; returns what it cost."""
        self.stats = SyncStats(
            receivers=self.receivers, slot_bytes=self.slot_bytes, transport=self.memory.kind
        )
        try:
            with PeakMeter(self.memory.device) as meter:
                for bucket in fill_slots(named, self.slot_bytes, self._open_slot):
                    self._publish(bucket)
                self._wait_acks(self._posted)
                end = self._posted
                self._post("end")
                # every receiver has let go of its mappings: the slots can go
                self._wait_acks(end + 1)
                self.stats.peak_extra_bytes = meter.peak_extra()
        except BaseException as e:
            why = str(e) if isinstance(e, WeightSyncAborted) else f"{type(e).__name__}: {e}"
            try:  # the receivers still waiting read this where they wait: the next message
                self._post("abort", why)
            except Exception:  # noqa: BLE001 - the store itself failed: the original error is the one to raise
                pass
            raise
        finally:
            self._slots.clear()
            self.memory.close()
        return self.stats

    def _post(self, kind: str, body: SlotHeader | str | None = None) -> None:
        self.control.post(self._posted, kind, body)
        self._posted += 1

    def _open_slot(self, index: int, capacity: int) -> torch.Tensor:
        """Slot ``index % IN_FLIGHT_BUCKETS`` for bucket ``index``, once every receiver is done with the bucket
        that held it; a new allocation when the capacity differs (a tensor larger than ``slot_bytes``)."""
        self._wait_acks(index - IN_FLIGHT_BUCKETS + 1)
        s = index % IN_FLIGHT_BUCKETS
        held = self._slots.get(s)
        if held is None or held.buf.numel() != capacity:
            # freed before the next is made: the bound holds across a resize
            self._slots.pop(s, None)
            buf, slot_id, handle = self.memory.allocate(capacity)
            self._slots[s] = _Slot(buf, slot_id, handle, first=index)
            self.stats.peak_slot_bytes = max(
                self.stats.peak_slot_bytes, sum(x.buf.numel() for x in self._slots.values())
            )
        return self._slots[s].buf

    def _publish(self, bucket: Filled) -> None:
        """The bucket is in its slot: stamp it, make the writes visible, post its header."""
        if self.verify:
            bucket.checksums = [
                tensor_checksum(t) for _, t in unpack_entries(bucket.data, bucket.entries)
            ]
        fault_injection.corrupt_weight_sync(self.sync, bucket.index, bucket.data)
        self.memory.ready()  # the slot's writes are done before any receiver reads it
        slot = self._slots[bucket.slot]
        assert self._posted == bucket.index, (self._posted, bucket.index)
        self._post(
            "bucket",
            SlotHeader(
                bucket.slot,
                slot.slot_id,
                slot.handle,
                bucket.data.numel(),
                bucket.entries,
                bucket.checksums,
                self.memory.kind,
            ),
        )
        if bucket.index == 0:
            fault_injection.in_weight_sync(self.sync)
        self.stats.bytes += bucket.data.numel()
        self.stats.buckets += 1

    def _wait_acks(self, upto: int) -> None:
        """Every receiver's acknowledgements of messages before ``upto``, in order; a receiver's error stops
        the sync (``WeightSyncAborted`` names it)."""
        while self._acked < upto:
            failed = self.control.acks(self._acked, self.receivers)
            if failed:
                member, error = failed[0]
                raise WeightSyncAborted(
                    f"weight sync {self.sync}: receiver {member} stopped at bucket "
                    f"{self._acked}: {error}"
                )
            for slot in self._slots.values():
                if not slot.seen and slot.first <= self._acked:
                    slot.seen = True
                    self.memory.mapped_by_all(slot.handle)
            self._acked += 1


@dataclass
class SlotReceiver:
    """The receiving end (``member``: its number among the sender's receivers). ``stream()`` yields the tensors in
    memory of this process's own; on a failure anywhere after it started, call ``abort`` so the sender stops.
    ``memory``: None to map the slots as the first header says (``slot_memory(kind)``)."""

    memory: SlotMemory | None
    control: StoreControl
    member: int
    sync: int | str = ""  # how errors name this sync
    _mapped: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    _next: int = 0  # the next message to take
    _done: bool = False
    copied_bytes: int = 0

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each bucket copied out of its slot, checked, acknowledged, then its tensors (views of the copy)."""
        while True:
            kind, body = self.control.take(self._next)
            if kind == "abort":
                self._done = True
                self._release()
                raise WeightSyncAborted(f"weight sync {self.sync}: the sender stopped it: {body}")
            if kind == "end":
                self._release()
                self.control.ack(self._next, self.member)
                self._done = True
                return
            tensors = self._copy(body)
            self.control.ack(self._next, self.member)
            self._next += 1
            yield from tensors
            del tensors

    def _copy_out(self, h: SlotHeader) -> torch.Tensor:
        """The bucket's bytes copied out of its slot (mapped as the header says). When that fails because the sender
        stopped meanwhile (a sender that fails frees its slots, so a header it posted just before may name a slot
        that is gone), the sender's reason is the error."""
        try:
            if self.memory is None:
                self.memory = slot_memory("cuda" if h.kind == "cuda_ipc" else "cpu")
            held = self._mapped.get(h.slot)
            if held is None or held[0] != h.slot_id:
                self._mapped.pop(h.slot, None)
                self._mapped[h.slot] = (h.slot_id, self.memory.open(h.handle))
            data = self.memory.copy_out(self._mapped[h.slot][1][: h.nbytes])
        except Exception as e:
            if (why := self.control.aborted()) is None:
                raise
            self._done = True
            self._release()
            raise WeightSyncAborted(f"weight sync {self.sync}: the sender stopped it: {why}") from e
        # let go before the acknowledgement (``CudaSlots.keep_mapped``)
        if not self.memory.keep_mapped:
            del self._mapped[h.slot]
        return data

    def _copy(self, h: SlotHeader) -> list[tuple[str, torch.Tensor]]:
        """The bucket in memory of this process's own (the slot is refilled once acknowledged), checked."""
        data = self._copy_out(h)
        tensors = unpack_entries(data, h.entries)
        if h.checksums is not None:
            for (name, t), want in zip(tensors, h.checksums):
                check_tensor(name, t, want, self.sync)
        self.copied_bytes += h.nbytes
        return tensors

    def _release(self) -> None:
        self._mapped.clear()
        if self.memory is not None:
            self.memory.close()

    def finish(self) -> None:
        """The consumer is done: a stream it left before the end marker would leave the sender waiting, so that
        is an error here (and the sender is told)."""
        if not self._done:
            error = RuntimeError(
                f"weight sync {self.sync}: the engine stopped reading before the last bucket"
            )
            self.abort(error)
            raise error

    def abort(self, error: BaseException) -> None:
        """This end failed (``error``): put it where the sender waits next, unless the stream had ended."""
        if self._done:
            return
        self._done = True
        self._release()
        self.control.ack(
            self._next, self.member, f"{type(error).__name__}: {error}"[:2000] or "failed"
        )
