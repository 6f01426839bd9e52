"""What every worker is given, and the base class of all roles."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollhpc.parallel import ParallelLayout, RankCoords
from rollhpc.protocol import probes
from rollhpc.protocol.dispatch import Collect, Dispatch, register
from rollhpc.protocol.spec import WorkerSpec

__all__ = ["Worker", "WorkerContext", "WorkerSpec", "register", "Dispatch", "Collect"]


@dataclass
class WorkerContext:
    role: str
    world_rank: int
    coords: RankCoords  # position in the role's parallel layout (group rank, tp/dp/pp ranks)
    group_size: int
    role_comm: (
        Any  # mpi4py communicator over this role's ranks only (for collectives inside the role)
    )
    run_dir: Path
    seed: int
    layout: ParallelLayout | None = None  # the role's whole layout (sizes of tp/pp/cp/ep/dp)

    @property
    def group_rank(self) -> int:
        return self.coords.group_rank


class Worker(WorkerSpec):
    """Base of every role's runtime. Methods marked ``@register(...)`` are callable from the controller.

    Its plan-time side (``Options``, ``check_layout``, ``check_model``, ``gpu_memory``) is ``WorkerSpec``'s: a
    worker with a spec module (rollhpc.protocol.spec) subclasses its spec first, so the two cannot disagree.
    """

    def __init__(self, ctx: WorkerContext, options: Any = None):
        self.ctx = ctx
        self.options = options

    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> dict[str, Any]:
        """Liveness and placement of each rank, for logs and tests."""
        import os
        import socket

        return {
            "role": self.ctx.role,
            "rank": self.ctx.world_rank,
            "group_rank": self.ctx.group_rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    @register(Dispatch.ONE_TO_ALL)
    def placement_probe(self, gpus: bool = True) -> dict[str, Any]:
        """Where this rank runs (host, GPUs, CPU cores) and the memory it holds now, for the cluster check
        (rollhpc.pipelines.cluster_check): here on the base class so that every role answers it. ``gpus``: whether
        the role has GPUs (a CPU role's probe leaves CUDA alone)."""
        return {
            "role": self.ctx.role,
            "rank": self.ctx.world_rank,
            "group_rank": self.ctx.group_rank,
            **probes.placement(gpus),
        }

    @register(Dispatch.ONE_TO_ALL)
    def collective_bandwidth(
        self,
        address: tuple[str, int],
        tag: str,
        rank: int,
        world: int,
        op: str,
        sizes: list[int],
        iters: int,
    ) -> dict[str, Any]:
        """Time ``op`` (all_reduce or broadcast) among ranks the controller chose, in a process group of their
        own that meets at ``address`` (the cluster check; protocol.probes): the role's own groups are left alone."""
        return probes.collective_bandwidth(address, tag, rank, world, op, sizes, iters)

    def close(self) -> None:
        """Called once at a normal shutdown: release engines, flush files."""
