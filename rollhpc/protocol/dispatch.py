"""The distribution contract of a worker method: how a call's arguments are dispatched to the
ranks of a group and how their results are collected.

The contract sits on the worker method (``@register``), so the controller's pipeline reads like
single-process code: ``train.train_step(batch)`` splits the batch by data-parallel rank and
concatenates what the data-parallel leaders return. Pure logic: no MPI here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from rollhpc.batch import Batch, RowArrays
from rollhpc.parallel import RankCoords


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"  # every rank gets the same arguments
    # Batch/RowArrays/list arguments cut into dp_size chunks; rank gets its dp chunk
    DP_SPLIT = "dp_split"
    RANK_ZERO = "rank_zero"  # only group rank 0 is called


class Collect(enum.Enum):
    ALL = "all"  # list of every called rank's result, in group-rank order
    DP_LEADERS = "dp_leaders"  # results of the dp leaders in dp order, concatenated when possible
    RANK_ZERO = "rank_zero"  # the result of group rank 0


@dataclass(frozen=True)
class Contract:
    dispatch: Dispatch
    collect: Collect


_DEFAULT_COLLECT = {
    Dispatch.ONE_TO_ALL: Collect.ALL,
    Dispatch.DP_SPLIT: Collect.DP_LEADERS,
    Dispatch.RANK_ZERO: Collect.RANK_ZERO,
}
_ATTR = "__rollhpc_contract__"


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL, collect: Collect | None = None) -> Callable:
    """Mark a worker method as callable from the controller, with its dispatch and collect modes."""
    if dispatch is Dispatch.RANK_ZERO and collect not in (None, Collect.RANK_ZERO):
        raise ValueError("a rank-zero call can only collect rank zero's result")
    contract = Contract(dispatch, collect or _DEFAULT_COLLECT[dispatch])

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTR, contract)
        return fn

    return mark


def _own_contract(klass: type, name: str) -> Contract | None:
    """The contract ``klass`` itself declares for ``name`` (not one inherited), if any."""
    return getattr(vars(klass).get(name), _ATTR, None)


def _remote_names(worker_cls: type) -> set[str]:
    return {
        name
        for klass in worker_cls.__mro__
        for name, fn in vars(klass).items()
        if callable(fn) and hasattr(fn, _ATTR)
    }


def _find_contract(worker_cls: type, method: str) -> Contract | None:
    """The contract of ``method``: the first class in the MRO whose own namespace holds a function carrying one.
    A runtime class implements its spec's remote methods without re-declaring them (rollhpc.protocol.spec), so
    the contract sits on the spec further down the MRO."""
    for klass in worker_cls.__mro__:
        contract = _own_contract(klass, method)
        if contract is not None:
            return contract
    return None


def remote_methods(worker_cls: type) -> dict[str, Contract]:
    """Every remote method of ``worker_cls`` (a runtime class or its spec) with its contract."""
    return {name: contract_of(worker_cls, name) for name in sorted(_remote_names(worker_cls))}


def contract_of(worker_cls: type, method: str) -> Contract:
    contract = _find_contract(worker_cls, method)
    if contract is None:
        known = ", ".join(sorted(remote_methods(worker_cls))) or "none"
        raise AttributeError(
            f"{worker_cls.__name__} has no remote method {method!r}; remote methods: {known}"
        )
    return contract


def check_contracts(worker_cls: type) -> None:
    """Refuse (TypeError) a class that changes an inherited remote method's contract, or whose declaration
    of one hides an implementation in another branch of its bases (the declaration would run instead): the
    controller, which reads only the spec, and the rank, which runs the runtime class, must agree."""
    for name in _remote_names(worker_cls):
        owners = [k for k in worker_cls.__mro__ if callable(vars(k).get(name))]
        declared = [(k, c) for k in owners if (c := _own_contract(k, name)) is not None]
        first_owner, first = declared[0]
        for owner, contract in declared[1:]:
            if contract != first:
                raise TypeError(
                    f"{first_owner.__name__}.{name} declares {first}, but {owner.__name__}.{name} "
                    f"declares {contract}: a remote method keeps its spec's contract"
                )
        if owners[0] is first_owner:
            _refuse_hidden_implementation(name, first_owner, owners[1:])


def _refuse_hidden_implementation(name: str, declarer: type, later: list[type]) -> None:
    # an undecorated ``name`` in a class the declarer does not derive from: a sibling base listed too late
    hidden = [k for k in later if _own_contract(k, name) is None and not issubclass(declarer, k)]
    if hidden:
        raise TypeError(
            f"the declaration {declarer.__name__}.{name} hides the implementation "
            f"{hidden[0].__name__}.{name}: list {hidden[0].__name__} before {declarer.__name__} "
            "among the bases"
        )


def _split_value(value: object, n: int) -> list[object]:
    if isinstance(value, (Batch, RowArrays)):  # a TrainingBatch is cut by rows as a Batch is
        return value.split(n)
    if isinstance(value, list):
        size, rest = divmod(len(value), n)
        out, start = [], 0
        for i in range(n):
            end = start + size + (1 if i < rest else 0)
            out.append(value[start:end])
            start = end
        return out
    return [value] * n


def split_arguments(args: tuple, kwargs: dict, dp_size: int) -> list[tuple[tuple, dict]]:
    """Per dp rank, the (args, kwargs) it receives: Batch, RowArrays and list values are cut, others replicated."""
    cut_args = [_split_value(a, dp_size) for a in args]
    cut_kwargs = {k: _split_value(v, dp_size) for k, v in kwargs.items()}
    return [
        (tuple(c[i] for c in cut_args), {k: c[i] for k, c in cut_kwargs.items()})
        for i in range(dp_size)
    ]


def targets(contract: Contract, coords: Sequence[RankCoords]) -> list[int]:
    """Group ranks that receive the call."""
    if contract.dispatch is Dispatch.RANK_ZERO:
        return [0]
    return [c.group_rank for c in coords]


def merge(results: list[object]) -> object:
    """Concatenate dp shards of the same kind; otherwise keep the list."""
    if results and all(isinstance(r, Batch) for r in results):
        return Batch.concat(results)
    if results and all(isinstance(r, list) for r in results):
        return [x for r in results for x in r]
    return results


def collect(contract: Contract, by_rank: dict[int, object], coords: Sequence[RankCoords]) -> object:
    """Turn {group_rank: result} into what the controller's caller receives."""
    if contract.collect is Collect.RANK_ZERO:
        return by_rank[0]
    if contract.collect is Collect.ALL:
        return [by_rank[r] for r in sorted(by_rank)]
    leaders = sorted((c for c in coords if c.is_dp_leader), key=lambda c: c.dp_rank)
    return merge([by_rank[c.group_rank] for c in leaders])
