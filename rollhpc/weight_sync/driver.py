"""The controller's side of a weight sync: trainer -> generators, whichever pipeline drives it.

Paths: ``broadcast`` (a process group of the trainer's rank 0 and the generators it serves, opened on first
use; the weights never pass through the controller), ``relay`` (bucketed exports collected by the controller
and sent to each generator over MPI: slower, but needs no extra process group), ``ipc`` (generators on the
GPU of the trainer's rank 0 map its buckets through CUDA IPC and copy device to device: no trip through the
host) and ``mixed``: ``weight_sync.routing`` decided per generator from the plan (``auto``), IPC for those
on the trainer's GPU and one broadcast group for the others, so no NCCL group ever holds two ranks of one
GPU. All load the new ``version`` into the engines, so completions record the policy that produced them.
"""

from __future__ import annotations

from typing import Any, Literal

from rollhpc.weight_sync.routing import BROADCAST, IPC, Routing

__all__ = ["WeightSync"]


class WeightSync:
    def __init__(self, train: Any, generate: Any, mode: Literal["broadcast", "relay", "ipc", "mixed"] = "broadcast",
                 bucket_mb: float = 64.0, routing: Routing | None = None, verify_every: int = 0,
                 adapters_only: bool = False):
        """``adapters_only``: a LoRA trainer sends its adapters alone, to generators that serve or merge them."""
        if mode == "mixed" and routing is None:
            raise ValueError("a mixed weight sync needs the routing that says which generator gets what")
        self.train, self.generate, self.mode, self.bucket_mb = train, generate, mode, bucket_mb
        self.adapters_only = adapters_only
        self.last_bytes: int | None = None  # what the last sync sent (broadcast and relay; None: not measured)
        self.routing = routing
        self.verify_every = verify_every  # 0: never; else the first sync and every verify_every-th after it
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
            buckets = train.share_weights(self.bucket_mb, verify, adapters)
            try:
                return max(gen.receive_shared_weights(buckets, version))
            finally:
                train.release_shared_weights()
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
        address = train.open_weight_channel()
        if members is None:
            world = 1 + len(gen)
            joined = [train.join_weight_channel.submit(world), gen.join_weight_channel.submit(address, world)]
        else:
            world = 1 + len(members)
            joined = [train.join_weight_channel.submit(world)] + [
                gen.at(g).join_weight_channel.submit(address, world, 1 + i) for i, g in enumerate(members)]
        for f in joined:
            f.result()
        self._channel_open = True

    def _mixed(self, version: int, verify: bool) -> float:
        """IPC to the generators on the trainer's GPU, the broadcast group for the others; both from the
        trainer's rank 0, one after the other (the trainer's buckets are shared until every IPC reader is done)."""
        train, gen = self.train, self.generate
        local, remote = self.routing.ranks(IPC), self.routing.ranks(BROADCAST)
        buckets = train.share_weights(self.bucket_mb, verify, self.adapters_only)
        try:
            loads = [f.result() for f in [gen.at(g).receive_shared_weights.submit(buckets, version) for g in local]]
        finally:
            train.release_shared_weights()
        if remote:
            self._open_channel(remote)
            sending = train.broadcast_weights.submit(self.bucket_mb, verify, self.adapters_only)
            receiving = [gen.at(g).receive_weights.submit(version) for g in remote]
            self.last_bytes = sending.result()
            loads += [f.result() for f in receiving]
        return max(loads)
