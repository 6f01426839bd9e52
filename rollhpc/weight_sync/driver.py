"""The controller's side of a weight sync: trainer -> generators, whichever pipeline drives it.

Paths: ``broadcast`` (a process group of the trainer's rank 0 and the generators it serves, opened on first
use; the weights never pass through the controller), ``relay`` (bucketed exports collected by the controller
and sent to each generator over MPI: slower, but needs no extra process group), ``ipc`` (generators on the
GPU of the trainer's rank 0 map its slots through CUDA IPC and copy device to device: no trip through the
host; on CPU, generators on its host map shared-memory slots) and ``mixed``: ``weight_sync.routing`` decided
per generator from the plan (``auto``), IPC for those on the trainer's GPU and one broadcast group for the
others, so no NCCL group ever holds two ranks of one GPU. All load the new ``version`` into the engines, so
completions record the policy that produced them.

Memory: ``ipc`` and ``broadcast`` stream (``relay`` gathers the model's buckets on the host). ``ipc`` goes
through ``IN_FLIGHT_BUCKETS`` reused slots of ``bucket_mb`` on the trainer's rank 0 (``weight_sync.slots``): the
controller starts both ends of one sync (the trainer's ``share_weights``, each receiver's
``receive_shared_weights``) and they pass the slots' handles and acknowledgements through the trainer's store,
one bucket at a time, so the trainer never holds the whole model packed (~57 GiB for a 30B MoE). ``broadcast``
packs into two reused slots too. The trainer's measured peak extra memory of the last IPC sync is
``last_stats["peak_extra_bytes"]``. When one end fails, the others stop (``slots.WeightSyncAborted``) and the
error raised here is the failing end's own.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from rollhpc.rollout.ports import Pending
from rollhpc.weight_sync.routing import BROADCAST, IPC, Routing

__all__ = ["WeightSync"]


class RemoteMethod(Protocol):
    """A worker's remote method as the controller calls it (``controller.worker_group.RemoteMethod``)."""

    def submit(self, *args: object, **kwargs: object) -> Pending[Any]: ...

    def __call__(self, *args: object, **kwargs: object) -> object: ...


class Remote(Protocol):
    """A group's ranks, or one of them, reached by method name (``controller.worker_group.RankProxy``)."""

    def __getattr__(self, method: str) -> RemoteMethod: ...


class Group(Remote, Protocol):
    """A worker group (``controller.worker_group.WorkerGroup``): the train or the generate role."""

    def __len__(self) -> int: ...

    def at(self, group_rank: int) -> Remote: ...


class WeightSync:
    def __init__(
        self,
        train: Group,
        generate: Group,
        mode: Literal["broadcast", "relay", "ipc", "mixed"] = "broadcast",
        bucket_mb: float = 64.0,
        routing: Routing | None = None,
        verify_every: int = 0,
        adapters_only: bool = False,
    ):
        """``adapters_only``: a LoRA trainer sends its adapters alone, to generators that serve or merge them."""
        if mode == "mixed" and routing is None:
            raise ValueError(
                "a mixed weight sync needs the routing that says which generator gets what"
            )
        self.train, self.generate, self.mode, self.bucket_mb = train, generate, mode, bucket_mb
        self.adapters_only = adapters_only
        self.last_bytes: int | None = None  # what the last sync sent (None: not measured)
        # the last IPC sync's SyncStats (slots, peak extra memory)
        self.last_stats: dict[str, Any] | None = None
        self._address: tuple[str, int] | None = None  # the trainer's store (open_weight_channel)
        self.routing = routing
        # 0: never; else the first sync and every verify_every-th after it
        self.verify_every = verify_every
        self.syncs = 0
        self._channel_open = False

    def _verify_now(self) -> bool:
        return self.verify_every > 0 and (self.syncs - 1) % self.verify_every == 0

    def __call__(self, version: int) -> float:
        """Send the trainer's weights as ``version``; returns the generators' load time (the slowest)."""
        train, gen = self.train, self.generate
        self.syncs += 1
        verify = self._verify_now()
        adapters = self.adapters_only
        if self.mode == "ipc":
            return max(self._shared(version, verify, list(range(len(gen)))))
        if self.mode == "relay":
            buckets = train.export_weights(self.bucket_mb, verify, adapters)
            self.last_bytes = sum(b.nbytes for b in buckets)
            return max(gen.update_weights(buckets, version))
        if self.mode == "mixed":
            return self._mixed(version, verify)
        self._open_channel(None)
        sending = train.broadcast_weights.submit(self.bucket_mb, verify, adapters)
        loading = gen.receive_weights.submit(version)
        self.last_bytes = sending.result()
        return max(loading.result())

    def _open_channel(self, members: list[int] | None) -> None:
        """The broadcast group: the trainer's rank 0 and ``members`` (generator group ranks; None: all of
        them, numbered by group rank), each member ``1 + its position``."""
        if self._channel_open:
            return
        train, gen = self.train, self.generate
        address = self._store_address()
        if members is None:
            world = 1 + len(gen)
            joined = [
                train.join_weight_channel.submit(world),
                gen.join_weight_channel.submit(address, world),
            ]
        else:
            world = 1 + len(members)
            joined = [train.join_weight_channel.submit(world)] + [
                gen.at(g).join_weight_channel.submit(address, world, 1 + i)
                for i, g in enumerate(members)
            ]
        for f in joined:
            f.result()
        self._channel_open = True

    def _store_address(self) -> tuple[str, int]:
        """The trainer's rendezvous store (opened once): the broadcast group forms through it, the IPC sync passes
        its headers and acknowledgements through it."""
        if self._address is None:
            self._address = tuple(self.train.open_weight_channel())
        return self._address

    def _shared(self, version: int, verify: bool, members: list[int]) -> list[float]:
        """Stream the weights through the trainer's slots to the generators ``members`` (group ranks): both ends
        run at once, the trainer refilling a slot only when every member has copied it; returns the load times."""
        address, tag = self._store_address(), f"sync-{self.syncs}"
        sending = self.train.share_weights.submit(
            len(members), tag, self.bucket_mb, verify, self.adapters_only
        )
        receiving = [
            self.generate.at(g).receive_shared_weights.submit(address, tag, version, i)
            for i, g in enumerate(members)
        ]
        self.last_stats, loads = _settle(sending, receiving)
        self.last_bytes = self.last_stats["bytes"]
        return loads

    def _mixed(self, version: int, verify: bool) -> float:
        """IPC to the generators on the trainer's GPU, the broadcast group for the others; both from the
        trainer's rank 0, one after the other."""
        local, remote = self.routing.ranks(IPC), self.routing.ranks(BROADCAST)
        loads = self._shared(version, verify, local) if local else []
        if remote:
            self._open_channel(remote)
            sending = self.train.broadcast_weights.submit(
                self.bucket_mb, verify, self.adapters_only
            )
            receiving = [self.generate.at(g).receive_weights.submit(version) for g in remote]
            self.last_bytes = sending.result()
            loads += [f.result() for f in receiving]
        return max(loads)


def _settle(
    sending: Pending[dict[str, Any]], receiving: list[Pending[float]]
) -> tuple[dict[str, Any], list[float]]:
    """The sender's reply and the receivers'. When an end raised, the others have stopped too (their error is a
    ``WeightSyncAborted`` that points at it): every reply is awaited and the first error that is not such an
    echo is raised, so the run reports the cause (a checksum mismatch, the engine's error, the export's). A
    rank that died or a call that timed out is raised at once (the rest would wait for nothing)."""
    values, errors = [], []
    for f in [*receiving, sending]:
        try:
            values.append(f.result())
        except Exception as e:  # noqa: BLE001 - sorted below
            if not hasattr(e, "err_type"):  # not a worker's raise (controller.errors.WorkerError)
                raise
            errors.append(e)
    if errors:
        raise next((e for e in errors if e.err_type != "WeightSyncAborted"), errors[0])
    return values[-1], values[:-1]
