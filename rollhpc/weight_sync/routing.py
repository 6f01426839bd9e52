"""Where each generator's weights come from, decided from the placement plan before anything starts.

The trainer's group rank 0 holds the full weights after a step (its first data-parallel replica gathers
them over tensor and pipeline parallelism), so it is the source of every sync. How a generator rank receives
them depends on where it sits:

- on the GPU of the trainer's rank 0 (the same het group, node and GPU: colocated): by CUDA IPC, device to
  device, never through NCCL, since NCCL refuses a communicator with two ranks on one GPU;
- on CPU, with ``weight_sync: ipc`` forced, on the host of the trainer's rank 0 (same het group and node, no
  GPUs on either): through shared-memory slots (``weight_sync.shared_memory``), the CPU's form of the same
  streamed protocol; ``auto`` keeps gloo's broadcast on CPU;
- anywhere else: in one broadcast group with the trainer's rank 0 (NCCL on GPUs, across nodes too; gloo
  on CPU), where each member works on its first GPU. Two members on one GPU would make NCCL refuse the
  group at the first sync, hours into a job, so such a layout is refused when the plan is made.

A generator rank's "place" is its first GPU: vLLM's driver process (the generator rank) uses its first visible
GPU as its device, and its tensor-parallel workers receive their shards from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BROADCAST",
    "IN_FLIGHT_BUCKETS",
    "IPC",
    "Route",
    "Routing",
    "RoutingError",
    "route_weights",
]

# How many buckets a sender holds at once on its device: one being read by the receivers while the next is
# packed. The memory plan counts a weight sync's extra memory as this many buckets of ``weight_sync_bucket_mb``;
# here, beside the routes and without torch, so that `rollhpc plan` reads it on a login node.
IN_FLIGHT_BUCKETS = 2

IPC = "ipc"
BROADCAST = "broadcast"


class PlacedRank(Protocol):
    """Where a rank runs, as the placement plan says (``placement.device_mapping.RankPlacement``)."""

    role: str
    group_rank: int
    component: int  # het group
    node: int
    gpus: tuple[int, ...]


class Plan(Protocol):
    """The placement plan (``placement.device_mapping.WorldPlan``): every rank's place."""

    @property
    def ranks(self) -> Sequence[PlacedRank]: ...


class RoutingError(ValueError):
    """A layout whose weight sync cannot work (said in one line, with what to change)."""


@dataclass(frozen=True)
class Route:
    generator: int  # the generator's group rank
    source: int  # the trainer group rank it receives from
    transport: str  # IPC or BROADCAST
    place: tuple[int, int, int] | None  # (het group, node, GPU) where it receives; None on CPU


@dataclass
class Routing:
    routes: list[Route]
    requested: str = "auto"  # the pipeline's weight_sync option it was made for

    @property
    def mode(self) -> str:
        """``ipc`` or ``broadcast`` when every route is the one kind, ``mixed`` when some of each."""
        kinds = {r.transport for r in self.routes}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def ranks(self, transport: str) -> list[int]:
        """The generator group ranks that receive by ``transport``."""
        return [r.generator for r in self.routes if r.transport == transport]

    def describe(self, bytes_per_sync: int | None) -> list[str]:
        """One line per generator rank: source, transport, where, bytes per sync (when the model is known)."""
        size = (
            f"{bytes_per_sync / 2**30:.2f} GiB"
            if bytes_per_sync
            else "size unknown (no config.json here)"
        )
        group = 1 + len(self.ranks(BROADCAST))
        lines = []
        for r in self.routes:
            where = (
                "CPU"
                if r.place is None
                else f"het group {r.place[0]} node {r.place[1]} GPU {r.place[2]}"
            )
            how = (
                "CUDA IPC (same GPU, device to device)"
                if r.transport == IPC and r.place is not None
                else "shared memory (same host, CPU)"
                if r.transport == IPC
                else f"broadcast ({'NCCL' if r.place is not None else 'gloo'}, group of {group})"
            )
            lines.append(
                f"  generate {r.generator:>3} <- train rank {r.source}: {how}; receives on {where}; {size}"
            )
        return lines


def _place(rank: PlacedRank) -> tuple[int, int, int] | None:
    return (rank.component, rank.node, rank.gpus[0]) if rank.gpus else None


def _same_host_on_cpu(a: PlacedRank, b: PlacedRank) -> bool:
    """Both ranks on one host without GPUs: shared memory reaches from one to the other."""
    return not a.gpus and not b.gpus and (a.component, a.node) == (b.component, b.node)


def route_weights(
    plan: Plan, mode: str = "auto", train_role: str = "train", generate_role: str = "generate"
) -> Routing:
    """The routing of ``plan`` (a WorldPlan) under the pipeline's ``weight_sync`` mode (``auto`` chooses per
    generator as above; ``broadcast`` and ``ipc`` force one transport; ``relay`` sends through the controller
    and forms no group). Raises RoutingError for a layout no sync can serve."""
    source = next((p for p in plan.ranks if p.role == train_role and p.group_rank == 0), None)
    gens = sorted((p for p in plan.ranks if p.role == generate_role), key=lambda p: p.group_rank)
    if source is None or not gens:
        return Routing([], mode)
    home = _place(source)
    routes = []
    for g in gens:
        colocated = (home is not None and _place(g) == home) or (
            mode == IPC and _same_host_on_cpu(source, g)
        )
        if mode == IPC and not colocated:
            raise RoutingError(
                f"pipeline.options.weight_sync=ipc needs every generator on the GPU of the trainer's rank 0 "
                f"({_where(home)}), or on CPU on its host; generate rank {g.group_rank} receives on "
                f"{_where(_place(g))}: use auto"
            )
        transport = IPC if (colocated and mode in ("auto", IPC)) else BROADCAST
        routes.append(Route(g.group_rank, source.group_rank, transport, _place(g)))
    routing = Routing(routes, mode)
    if mode == "relay":
        return routing
    members = [("the trainer's rank 0", home)] + [
        (f"generate rank {r.generator}", r.place) for r in routes if r.transport == BROADCAST
    ]
    seen: dict[tuple[int, int, int], str] = {}
    for who, place in members:
        if place is None:
            continue
        if place in seen:
            raise RoutingError(
                f"weight sync: {seen[place]} and {who} would both be in the broadcast group on {_where(place)}, "
                f"and NCCL refuses two ranks of one GPU in a group: give each generator a first GPU of its own"
                + (
                    ", or put it on the trainer's rank 0's GPU (then it receives by CUDA IPC)"
                    if mode == "auto"
                    else ", or set pipeline.options.weight_sync=auto"
                )
            )
        seen[place] = who
    return routing


def _where(place: tuple[int, int, int] | None) -> str:
    return "CPU" if place is None else f"GPU {place[2]} of node {place[1]} in het group {place[0]}"
