"""Proxies for a role's ranks: ``group.method(...)`` dispatches by the method's contract.

``group.train_step(batch)`` blocks and returns the collected result;
``group.train_step.submit(batch)`` returns a ``GroupFuture`` at once, so calls on several groups
overlap. Attribute access is checked against the remote methods the role's spec declares (a group is built
from ``config.import_spec``: the controller never imports a role's runtime), so a typo fails on the
controller with the list of remote methods instead of on a worker.
"""

from __future__ import annotations

from typing import Any, Callable

from rollhpc.controller.runtime import Controller
from rollhpc.parallel import ParallelLayout
from rollhpc.protocol.dispatch import (
    Contract,
    Dispatch,
    collect,
    contract_of,
    split_arguments,
    targets,
)
from rollhpc.protocol.spec import WorkerSpec
from rollhpc.transport.mpi_channel import Encoded


class GroupFuture:
    """A call in flight on a group; ``result()`` waits (with the run's timeout unless given)."""

    def __init__(
        self,
        group: "WorkerGroup",
        method: str,
        keys: list[tuple[int, int]],
        collect_fn: Callable[[dict[int, Any]], Any],
    ):
        self._group = group
        self._method = method
        self._keys = keys
        self._collect = collect_fn  # {group rank: reply} -> what the caller receives
        self._value: object = None
        self._done = False

    def done(self) -> bool:
        return self._done or self._group.controller.ready(self._keys)

    def result(self, timeout_s: float | None = None) -> Any:
        if not self._done:
            what = f"call {self._method!r} on role {self._group.role!r}"
            replies = self._group.controller.wait(self._keys, what, timeout_s)
            self._value = self._collect(
                {self._group.group_rank_of[r]: v for r, v in replies.items()}
            )
            self._done = True
        return self._value


class RemoteMethod:
    def __init__(
        self, group: "WorkerGroup", name: str, contract: Contract, only_rank: int | None = None
    ):
        self._group = group
        self._name = name
        self.contract = contract
        self._only_rank = only_rank

    def submit(self, *args: object, **kwargs: object) -> GroupFuture:
        if self._only_rank is not None:
            return self._group.submit_to(self._only_rank, self._name, *args, **kwargs)
        return self._group.submit(self._name, *args, **kwargs)

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return self.submit(*args, **kwargs).result()


class WorkerGroup:
    def __init__(
        self,
        controller: Controller,
        role: str,
        worker_cls: type[WorkerSpec],
        world_ranks: list[int],
        layout: ParallelLayout,
    ):
        self.controller = controller
        self.role = role
        self.worker_cls = worker_cls
        self.world_ranks = world_ranks  # index = group rank
        self.group_rank_of = {r: i for i, r in enumerate(world_ranks)}
        self.layout = layout
        # every rank's coordinates, computed once: per call they would cost O(ranks) of rank 0's time
        self.coords = layout.all_coords()

    def __len__(self) -> int:
        return len(self.world_ranks)

    def __getattr__(self, name: str) -> RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return RemoteMethod(self, name, contract_of(self.worker_cls, name))

    def at(self, group_rank: int) -> "RankProxy":
        """One rank of the group, called with its arguments as given (no split, no collect): what a
        sample-level scheduler needs to keep every generator busy on its own requests."""
        if not 0 <= group_rank < len(self.world_ranks):
            raise IndexError(
                f"role {self.role!r} has ranks 0..{len(self.world_ranks) - 1}, not {group_rank}"
            )
        return RankProxy(self, group_rank)

    def submit_to(
        self, group_rank: int, method: str, *args: object, **kwargs: object
    ) -> GroupFuture:
        # the method must be remote; its dispatch mode does not apply
        contract_of(self.worker_cls, method)
        keys = self.controller.submit(
            method, {self.world_ranks[group_rank]: Encoded.of((args, kwargs))}
        )
        return GroupFuture(self, method, keys, lambda by_rank: by_rank[group_rank])

    def submit(self, method: str, *args: object, **kwargs: object) -> GroupFuture:
        contract = contract_of(self.worker_cls, method)
        coords = self.coords
        called = targets(contract, coords)
        if contract.dispatch is Dispatch.DP_SPLIT:
            chunks = [Encoded.of(p) for p in split_arguments(args, kwargs, self.layout.dp)]
            payloads = {self.world_ranks[g]: chunks[coords[g].dp_rank] for g in called}
        else:
            enc = Encoded.of((args, kwargs))
            ranks = [self.world_ranks[g] for g in called]
            if self.controller.fans_out(self.role, ranks, enc):
                keys = self.controller.submit_fanout(method, self.role, enc)
                return GroupFuture(
                    self, method, keys, lambda by_rank: collect(contract, by_rank, coords)
                )
            payloads = {r: enc for r in ranks}
        keys = self.controller.submit(method, payloads)
        return GroupFuture(self, method, keys, lambda by_rank: collect(contract, by_rank, coords))


class RankProxy:
    def __init__(self, group: WorkerGroup, group_rank: int):
        self._group = group
        self.group_rank = group_rank

    def __getattr__(self, name: str) -> RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return RemoteMethod(
            self._group, name, contract_of(self._group.worker_cls, name), only_rank=self.group_rank
        )
