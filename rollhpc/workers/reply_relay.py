"""A worker's replies: to the controller itself, or up the call's reply tree (rollhpc.transport.reply_tree).

A call to ``controller.reply_tree_min_ranks`` ranks or more names a tree the controller described to each of its
ranks beforehand (a "tree" message: this rank's parent and children). After its own part of such a call, a rank
collects its children's bundles for the same call, adds its own reply and sends the whole up: to its parent, or
to the controller at the top. It takes its next call only then: every rank of the call runs the same call, so
what a relay waits for never depends on what it would do next. A child that dies leaves its relay waiting; the
controller sees the death on the child's sideband connection and ends the run, as it would without a tree.
"""

from __future__ import annotations

from typing import Any

from rollhpc.transport.mpi_channel import (
    TAG_RELAY,
    TAG_REPLY,
    Backoff,
    Encoded,
    Message,
    MpiChannel,
)
from rollhpc.transport.reply_tree import CONTROLLER, Bundle


class ReplyRouter:
    def __init__(self, channel: MpiChannel, rank: int):
        self.channel = channel
        self.rank = rank
        self.trees: dict[int, tuple[int, tuple[int, ...]]] = {}  # tree id -> (parent, children)
        self._held: dict[
            tuple[int, int], Message
        ] = {}  # (child, call id) -> its bundle, taken before it was wanted

    def learn(self, envelope: dict[str, Any]) -> None:
        """A "tree" message: this rank's place in a tree the controller will name in its calls."""
        self.trees[envelope["tree"]] = (envelope["parent"], tuple(envelope["children"]))

    def send(
        self, call: dict[str, Any], reply: dict[str, Any], encoded: Encoded, result: object
    ) -> None:
        """``reply`` to the call whose envelope is ``call``: straight to the controller unless the call came with
        a tree, then with the children's replies in one bundle up the tree (``result`` itself goes in: a bundle
        encodes its results together; ``encoded``, the same result encoded alone, is for the controller). An error
        goes straight to the controller in any case (a relay may be slow to pass it on: its own part of the call,
        or a sibling that hangs because of this very error), and the tree gets this rank's bundle without it."""
        tree = call.get("tree")
        if tree is None or "error" in reply:
            self.channel.send_encoded(CONTROLLER, TAG_REPLY, reply, encoded)
            if tree is None:
                return
            own = Bundle.merge([])
        else:
            own = Bundle.of_reply(self.rank, reply, result)
        parent, children = self.trees[tree]
        call_id = call["call_id"]
        bundle = (
            Bundle.merge([own, *(self._collect(child, call_id) for child in children)])
            if children
            else own
        )
        envelope, data = bundle.encode(call_id)
        self.channel.send(parent, TAG_REPLY if parent == CONTROLLER else TAG_RELAY, envelope, data)

    def _collect(self, child: int, call_id: int) -> Bundle:
        """``child``'s bundle for ``call_id``, waiting for it; bundles of other calls (or other children) that
        arrive first are held until they are wanted."""
        backoff = Backoff(hot_s=0.002, max_sleep_s=0.001)
        key = (child, call_id)
        while key not in self._held:
            msg = self.channel.poll(TAG_RELAY)
            if msg is None:
                self.channel.progress()
                backoff.wait()
                continue
            self._held[(msg.source, msg.envelope["call_id"])] = msg
            backoff.reset()
        msg = self._held.pop(key)
        return Bundle.decode(msg.envelope, msg.payload)
