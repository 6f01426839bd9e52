"""What every worker is given, and the base class of all roles."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollhpc.parallel import ParallelLayout, RankCoords
from rollhpc.protocol import probes
from rollhpc.protocol.dispatch import Collect, Dispatch, register
from rollhpc.protocol.spec import WorkerSpec

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["Worker", "WorkerContext", "WorkerSpec", "register", "Dispatch", "Collect"]


@dataclass
class WorkerContext:
    role: str
    world_rank: int
    coords: RankCoords  # position in the role's parallel layout (group rank, tp/dp/pp ranks)
    group_size: int
    role_comm: MPI.Comm  # over this role's ranks only (for collectives inside the role)
    run_dir: Path
    seed: int
    layout: ParallelLayout | None = None  # the role's whole layout (sizes of tp/pp/cp/ep/dp)

    @property
    def group_rank(self) -> int:
        return self.coords.group_rank


class Worker(WorkerSpec):
    """Base of every role's runtime. Methods marked ``@register(...)`` are callable from the controller.

    Its plan-time side (``Options``, ``check_layout``, ``check_model``, ``gpu_memory``) and the remote methods
    every role answers are ``WorkerSpec``'s: a worker with a spec module (rollhpc.protocol.spec) subclasses its
    spec first and implements the remote methods the spec declares, so the two cannot disagree.
    """

    def __init__(self, ctx: WorkerContext, options: Any = None):
        self.ctx = ctx
        self.options = options

    def ping(self) -> dict[str, Any]:
        """Liveness and placement of each rank, for logs and tests."""
        return {
            "role": self.ctx.role,
            "rank": self.ctx.world_rank,
            "group_rank": self.ctx.group_rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

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

    def close(self) -> None:
        """Called once at a normal shutdown: release engines, flush files."""
