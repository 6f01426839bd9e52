"""The train role's end of the weight sync (rollhpc.weight_sync): the Megatron chunks' weights gathered into
Hugging Face names on rank 0, then broadcast to the generators' group or streamed through reused slots (CUDA IPC
or shared memory) to colocated ones."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rollhpc.models.megatron_pipeline import export_pipeline_hf_weights
from rollhpc.transport.rendezvous import rendezvous_host
from rollhpc.weight_sync.broadcast import WeightBroadcast, open_store
from rollhpc.weight_sync.slots import SlotSender, StoreControl, slot_memory


class WeightChannelMixin:
    """The sending end of ``weight_sync.broadcast``: trainer rank 0 hosts the rendezvous and broadcasts. Mixed into
    the train role's worker, whose ``chunks``, ``tp_group``, ``vocab_size``, ``device`` and context it reads."""

    def _exported_on_rank_zero(
        self, adapters_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Collective: the full weights in Hugging Face names, gathered over TP within the first data-parallel
        replica (with EP its expert shards span several DP ranks), as a lazy iterator on group rank 0; None on
        every other rank, which has taken part in the gathers (or, in another replica, had none to join).
        ``adapters_only``: a LoRA policy's adapters alone, for generators that merge them (engine: torch)."""
        if adapters_only and getattr(self.options, "lora", None) is None:
            raise RuntimeError(
                f"role {self.ctx.role!r}: adapters-only weight sync without LoRA adapters"
            )
        if self.ctx.coords.edp_rank != 0:
            return None
        named = export_pipeline_hf_weights(
            self.chunks, self.vocab_size, self.tp_group, adapters_only
        )
        if self.ctx.group_rank == 0:
            return named
        for _ in named:  # the other TP ranks take part in the gathers only
            pass
        return None

    def open_weight_channel(self) -> tuple[str, int]:
        """The rendezvous store's address (opened on the first call): the broadcast group forms through it and the
        streamed IPC / shared-memory sync passes its headers and acknowledgements through it."""
        if getattr(self, "_store", None) is None:
            self._store = open_store()
        return rendezvous_host(), int(self._store.port)

    def join_weight_channel(self, world: int) -> None:
        self._channel = WeightBroadcast(0, world, "", 0, store=self._store, device=self.device)

    def broadcast_weights(
        self, bucket_mb: float = 64.0, verify: bool = False, adapters_only: bool = False
    ) -> int | None:
        """Gather the weights over TP (first DP replica) and broadcast them from rank 0; returns bytes sent.
        ``verify``: with a checksum per tensor (``weight_sync.buckets.stamp``); ``adapters_only``: LoRA's adapters."""
        named = self._exported_on_rank_zero(adapters_only)
        return (
            None if named is None else self._channel.send(named, int(bucket_mb * (1 << 20)), verify)
        )

    def share_weights(
        self,
        receivers: int,
        tag: str,
        bucket_mb: float = 512.0,
        verify: bool = False,
        adapters_only: bool = False,
    ) -> dict[str, Any] | None:
        """Stream the weights to ``receivers`` generators on rank 0's GPU (CUDA IPC) or host (shared memory, on CPU)
        through ``IN_FLIGHT_BUCKETS`` reused slots of ``bucket_mb`` (``weight_sync.slots``), the headers and
        acknowledgements through the store of ``open_weight_channel`` under ``tag``; returns rank 0's
        ``SyncStats`` (bytes, slots' peak, measured peak extra memory). Returns once every receiver has copied
        every bucket: the slots are freed then."""
        named = self._exported_on_rank_zero(adapters_only)
        if named is None:
            return None
        self._shared_syncs = getattr(self, "_shared_syncs", 0) + 1
        sender = SlotSender(
            slot_memory(self.device),
            StoreControl(self._store, tag),
            receivers,
            int(bucket_mb * (1 << 20)),
            verify=verify,
            sync=self._shared_syncs,
        )
        return sender.send(named).as_dict()
