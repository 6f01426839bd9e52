"""The controller's side of a weight sync: trainer -> generators, whichever pipeline drives it.

Three paths: ``broadcast`` (a process group of the trainer's rank 0 and every generator, opened on first
use; the weights never pass through the controller), ``relay`` (bucketed exports collected by the controller
and sent to each generator over MPI: slower, but needs no extra process group) and ``ipc`` (generators on
the GPU of the trainer's rank 0 map its buckets through CUDA IPC and copy device to device: no trip
through the host). ``auto`` picks ``ipc`` from the plan when every generator shares that GPU, else
``broadcast``. All load the new ``version`` into the engines, so completions record the policy that
produced them.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["WeightSync", "choose_mode"]


def choose_mode(mode: str, plan: Any, train_role: str = "train", generate_role: str = "generate") -> str:
    """``auto`` -> ``ipc`` when every generator rank sits on exactly the GPU(s) of the trainer's rank 0 (the
    same het group, node and GPUs in ``plan``, a WorldPlan), else ``broadcast``; other modes as given."""
    if mode != "auto":
        return mode
    first = next((p for p in plan.ranks if p.role == train_role and p.group_rank == 0), None)
    gens = [p for p in plan.ranks if p.role == generate_role]
    same = first is not None and first.gpus and gens and all(
        (g.component, g.node, g.gpus) == (first.component, first.node, first.gpus) for g in gens)
    return "ipc" if same else "broadcast"


class WeightSync:
    def __init__(self, train: Any, generate: Any, mode: Literal["broadcast", "relay", "ipc"] = "broadcast",
                 bucket_mb: float = 64.0):
        self.train, self.generate, self.mode, self.bucket_mb = train, generate, mode, bucket_mb
        self._channel_open = False

    def __call__(self, version: int) -> float:
        """Send the trainer's weights as ``version``; returns the generators' load time (the slowest)."""
        train, gen = self.train, self.generate
        if self.mode == "ipc":
            buckets = train.share_weights(self.bucket_mb)
            try:
                return max(gen.receive_shared_weights(buckets, version))
            finally:
                train.release_shared_weights()
        if self.mode == "relay":
            buckets = train.export_weights(self.bucket_mb)
            return max(gen.update_weights(buckets, version))
        if not self._channel_open:
            address = train.open_weight_channel()
            joined = [train.join_weight_channel.submit(1 + len(gen)),
                      gen.join_weight_channel.submit(address, 1 + len(gen))]
            for f in joined:
                f.result()
            self._channel_open = True
        sending = train.broadcast_weights.submit(self.bucket_mb)
        loading = gen.receive_weights.submit(version)
        sending.result()
        return max(loading.result())
