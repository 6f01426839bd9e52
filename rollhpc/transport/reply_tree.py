"""Replies gathered along a tree: who collects whose reply to a call on many ranks, and how they travel together.

Why: the controller pays per message it takes (a probe, a receive, an unpickle, its bookkeeping: ~40 us a rank
at 256 ranks, bench/scale.py), so a call to the 8,769 ranks of the largest shipped plan would cost rank 0 about a
third of a second in replies alone. Over a tree, each node leader collects its node's replies (through the node's
shared memory) and the leaders' replies are collected again in groups of ``fan_in``, so rank 0 takes at most
``fan_in`` messages per call, each a bundle of many replies. What rank 0 still does per rank is the decode of
that rank's reply, which the caller's result needs anyway.

Order does not matter on the controller: a reply is filed under (rank, call id), what a reply carries beside its
result adds up (seconds in calls, released shared-memory files) or only grows (CPU seconds), so a direct reply
that overtakes a relayed one (a rank's next call went to it alone) changes nothing. Errors never wait on a
relay: a rank whose call raised sends its error to the controller itself, and an empty bundle up the tree.

Pure logic and numpy: no MPI here (rollhpc.workers.reply_relay sends and collects; the controller unpacks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from rollhpc.transport import wire

CONTROLLER = 0
_ALIGN = 64  # each buffer of a bundle starts at a multiple of this: the arrays viewing it are aligned for any dtype


@dataclass(frozen=True)
class ReplyTree:
    """For each called rank: where its reply goes (``parent``, the controller at the top) and whose replies it
    collects first (``children``, in the order it takes them)."""

    parent: dict[int, int]
    children: dict[int, tuple[int, ...]]

    def depth(self) -> int:
        """Hops from the deepest rank to the controller."""
        def hops(r: int) -> int:
            n = 1
            while (r := self.parent[r]) != CONTROLLER:
                n += 1
            return n

        return max(hops(r) for r in self.parent)


def build_reply_tree(ranks: Sequence[int], hosts: Mapping[int, str], fan_in: int) -> ReplyTree:
    """A tree over ``ranks`` (each once) that sends the controller at most ``fan_in`` messages.

    First level: each host's ranks, in rank order, in groups of at most ``fan_in``; the first of a group (its node
    leader) collects the others', over the node's own memory. Next levels: the leaders in rank order, in groups of
    ``fan_in``, the first collecting the others', until at most ``fan_in`` remain; those reply to the controller.
    A rank collects ``fan_in - 1`` replies per level it leads, so no rank waits on more than
    ``(fan_in - 1) * depth`` messages."""
    if fan_in < 2:
        raise ValueError(f"a reply tree needs a fan-in of 2 or more, not {fan_in}")
    if len(set(ranks)) != len(ranks) or CONTROLLER in ranks:
        raise ValueError("a reply tree's ranks are distinct worker ranks")
    parent: dict[int, int] = {}
    children: dict[int, list[int]] = {r: [] for r in ranks}
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(hosts[r], []).append(r)
    heads: list[int] = []
    for members in by_host.values():
        heads += _group(members, fan_in, parent, children)
    heads.sort()
    while len(heads) > fan_in:
        heads = _group(heads, fan_in, parent, children)
    for r in heads:
        parent[r] = CONTROLLER
    return ReplyTree(parent, {r: tuple(c) for r, c in children.items() if c})


def _group(members: list[int], fan_in: int, parent: dict[int, int], children: dict[int, list[int]]) -> list[int]:
    """``members`` in groups of ``fan_in``, each group's first collecting the others; returns the firsts."""
    heads = []
    for i in range(0, len(members), fan_in):
        head, *rest = members[i:i + fan_in]
        for r in rest:
            parent[r] = head
            children[head].append(r)
        heads.append(head)
    return heads


Item = tuple[int, dict, bytes, list[int], list[int]]  # (source rank, envelope, header, buffer sizes, offsets)


@dataclass
class Bundle:
    """Replies travelling as one message: ``items`` (each rank's envelope and pickled header, its buffers' sizes
    and their offsets in ``data``) and ``data``, every buffer back to back. Sent as the envelope
    ``{"kind": "bundle", "call_id": ..., "items": ...}`` with ``data`` as the payload (one raw buffer)."""

    items: list[Item]
    data: np.ndarray  # uint8

    @classmethod
    def empty(cls) -> "Bundle":
        return cls([], np.empty(0, dtype=np.uint8))

    @classmethod
    def of_reply(cls, source: int, envelope: dict, header: bytes, buffers: Sequence[memoryview]) -> "Bundle":
        """One rank's encoded reply (rollhpc.transport.mpi_channel.Encoded's header and buffers)."""
        sizes = [m.nbytes for m in buffers]
        offsets, total = _layout(sizes, 0)
        data = np.empty(total, dtype=np.uint8)
        for m, off in zip(buffers, offsets):
            data[off:off + m.nbytes] = np.frombuffer(m, dtype=np.uint8)
        return cls([(source, envelope, header, sizes, offsets)], data)

    @classmethod
    def merge(cls, bundles: Sequence["Bundle"]) -> "Bundle":
        """Several bundles as one: their items in order, their data copied once into one array."""
        items: list[Item] = []
        starts, end = [], 0
        for b in bundles:
            end += -end % _ALIGN
            starts.append(end)
            end += b.data.nbytes
        data = np.empty(end, dtype=np.uint8)
        for b, start in zip(bundles, starts):
            data[start:start + b.data.nbytes] = b.data
            items += [(src, env, head, sizes, [start + o for o in offs]) for src, env, head, sizes, offs in b.items]
        return cls(items, data)

    def replies(self) -> Iterator[tuple[int, dict, Any]]:
        """(source, envelope, decoded payload) of each item; arrays in the payloads are views of ``data``."""
        for src, env, head, sizes, offs in self.items:
            yield src, env, wire.decode(head, [self.data[o:o + n] for o, n in zip(offs, sizes)])


def _layout(sizes: Sequence[int], start: int) -> tuple[list[int], int]:
    offsets, pos = [], start
    for n in sizes:
        pos += -pos % _ALIGN
        offsets.append(pos)
        pos += n
    return offsets, pos
