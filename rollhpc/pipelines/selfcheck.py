"""Exercise a world end to end and say what works: placement, dispatch modes, a large payload."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from rollhpc.batch import Batch
from rollhpc.protocol.pipeline import Pipeline

log = logging.getLogger("rollhpc.selfcheck")


class SelfCheck(Pipeline):
    @dataclass(kw_only=True)
    class Options:
        payload_mib: int = 16

    def run(self) -> None:
        for role, workers in self.workers.items():
            for p in workers.ping():
                log.info(
                    "%s rank %d (group rank %d) on %s pid %d",
                    role,
                    p["rank"],
                    p["group_rank"],
                    p["host"],
                    p["pid"],
                )
        probe = next(iter(self.workers.values()))
        if not hasattr(probe.worker_cls, "checksum"):
            return
        rows = Batch({"x": np.arange(10 * len(probe))})
        tagged = probe.tag_rows(rows)
        assert (tagged["x"] == rows["x"]).all(), "dp split/concat changed the rows"
        data = np.random.default_rng(0).integers(
            0, 255, self.options.payload_mib << 20, dtype=np.uint8
        )
        t = time.perf_counter()
        sums = probe.checksum(data)
        dt = time.perf_counter() - t
        assert all(s == int(data.sum(dtype=np.uint64)) for s in sums), (
            "payload corrupted in transit"
        )
        log.info(
            "%d MiB to %d ranks and back in %.3f s; all checksums match",
            self.options.payload_mib,
            len(probe),
            dt,
        )
