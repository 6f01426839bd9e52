"""The controller's side of a weight sync: trainer -> generators, whichever pipeline drives it.

Two paths: ``broadcast`` (a process group of the trainer's rank 0 and every generator, opened on first use;
the weights never pass through the controller) and ``relay`` (bucketed exports collected by the controller
and sent to each generator over MPI: slower, but needs no extra process group). Both load the new
``version`` into the engines, so completions record the policy that produced them.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["WeightSync"]


class WeightSync:
    def __init__(self, train: Any, generate: Any, mode: Literal["broadcast", "relay"] = "broadcast",
                 bucket_mb: float = 64.0):
        self.train, self.generate, self.mode, self.bucket_mb = train, generate, mode, bucket_mb
        self._channel_open = False

    def __call__(self, version: int) -> float:
        """Send the trainer's weights as ``version``; returns the generators' load time (the slowest)."""
        train, gen = self.train, self.generate
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
