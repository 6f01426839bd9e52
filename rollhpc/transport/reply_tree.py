"""Replies gathered along a tree: who collects whose reply to a call on many ranks, and how they travel together.

Why: the controller pays per message it takes (a probe, a receive, an unpickle, its bookkeeping: ~4 us of its own
work a reply, bench/reply_path.py, and several times that where it shares its cores), so a call to the 8,769 ranks
of the largest shipped plan costs rank 0 ~37 ms in replies alone, during which it routes no samples. Over a tree,
each node leader collects its node's replies (through the node's shared memory) and the leaders' replies are
collected again in groups of ``fan_in``, so rank 0 takes at most ``fan_in`` messages per call, each a bundle of
many replies whose results are one list, unpickled at once. What rank 0 still does per rank is to file that rank's
result (a few dictionary operations).

Order does not matter on the controller: a reply is filed under (rank, call id), what a reply carries beside its
result adds up (seconds in calls, released shared-memory files) or only grows (CPU seconds), so a direct reply
that overtakes a relayed one (a rank's next call went to it alone) changes nothing. Errors never wait on a
relay: a rank whose call raised sends its error to the controller itself, and an empty bundle up the tree.

Pure logic and numpy: no MPI here (rollhpc.workers.reply_relay sends and collects; the controller unpacks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from rollhpc.transport import wire
from rollhpc.transport.envelope import Kind

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


def _group(
    members: list[int], fan_in: int, parent: dict[int, int], children: dict[int, list[int]]
) -> list[int]:
    """``members`` in groups of ``fan_in``, each group's first collecting the others; returns the firsts."""
    heads = []
    for i in range(0, len(members), fan_in):
        head, *rest = members[i : i + fan_in]
        for r in rest:
            parent[r] = head
            children[head].append(r)
        heads.append(head)
    return heads


@dataclass
class Bundle:
    """The replies of several ranks to one call, as one message: per rank (in ``ranks``' order) its seconds inside
    the call, its process's CPU seconds and the shared-memory files it released, and the results as one list.

    The results are encoded together (one pickle, their arrays as buffers back to back in ``data``): the
    controller unpickles one list per bundle instead of one header per rank, and files each result with a few
    dictionary operations (bench/reply_path.py). A relay decodes its children's lists and encodes the whole
    again, so that work is spread over the relays, a subtree's worth each."""

    ranks: list[int]
    call_s: list[float]
    cpu_s: list[float]
    released: dict[int, list[str]]  # only the ranks that released a file
    results: list[Any]

    @classmethod
    def of_reply(cls, rank: int, reply: dict[str, Any], result: object) -> Bundle:
        """One rank's reply envelope (rollhpc.workers.serve) and its result."""
        released = {rank: reply["released"]} if reply.get("released") else {}
        return cls(
            [rank], [reply.get("call_s", 0.0)], [reply.get("cpu_s", 0.0)], released, [result]
        )

    @classmethod
    def merge(cls, bundles: Sequence["Bundle"]) -> "Bundle":
        out = cls([], [], [], {}, [])
        for b in bundles:
            out.ranks += b.ranks
            out.call_s += b.call_s
            out.cpu_s += b.cpu_s
            out.released.update(b.released)
            out.results += b.results
        return out

    def encode(self, call_id: int) -> tuple[dict[str, Any], np.ndarray]:
        """(envelope, data) of the message that carries this bundle: the data is every buffer of the results,
        each at an aligned offset of one array (one receive, however many arrays the results hold)."""
        header, buffers = wire.encode(self.results)
        sizes = [m.nbytes for m in buffers]
        offsets, total = wire.layout(sizes, _ALIGN)
        data = np.empty(total, dtype=np.uint8)
        for m, off in zip(buffers, offsets):
            data[off : off + m.nbytes] = np.frombuffer(m, dtype=np.uint8)
        envelope = {
            "kind": Kind.BUNDLE,
            "call_id": call_id,
            "ranks": self.ranks,
            "call_s": self.call_s,
            "cpu_s": self.cpu_s,
            "released": self.released,
            "header": header,
            "sizes": sizes,
            "offsets": offsets,
        }
        return envelope, data

    @classmethod
    def decode(cls, envelope: dict[str, Any], data: np.ndarray) -> "Bundle":
        """The bundle of a received message; arrays in the results are views of ``data``."""
        views = [data[o : o + n] for o, n in zip(envelope["offsets"], envelope["sizes"])]
        return cls(
            envelope["ranks"],
            envelope["call_s"],
            envelope["cpu_s"],
            envelope["released"],
            wire.decode(envelope["header"], views),
        )
