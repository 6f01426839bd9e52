"""The kinds of message between the controller and its workers: the ``"kind"`` of every envelope on the wire
(``rollhpc.transport.mpi_channel``), named once here for both ends (``rollhpc.controller.runtime`` and
``rollhpc.workers.serve``).

Plain strings, not an enum: every envelope is pickled, and an enum member would travel as a reference to its
class (more bytes, and a class lookup to unpickle it on rank 0, which takes a reply from each rank of every
call). So the wire carries what it always did, and ``Kind`` is only a namespace for the names.
"""

from __future__ import annotations

from typing import Final


class Kind:
    """The ``"kind"`` of an envelope, by direction and in the order a worker's life meets them."""

    # the controller to a worker (TAG_CALL)
    BUILD: Final = "build"  # construct the role's worker now (roles sharing GPUs build in turns); answered READY
    # this rank's place (parent, children) in a reply tree that later calls name
    TREE: Final = "tree"
    # run ``method`` on the payload's (args, kwargs); answered RESULT, or along the tree
    CALL: Final = "call"
    SHUTDOWN: Final = "shutdown"  # close the worker and leave (built or not yet); answered BYE
    # a worker to the controller (TAG_REPLY), or to its relay in a reply tree (TAG_RELAY)
    READY: Final = "ready"  # built (with its construction times), or the constructor's error
    RESULT: Final = "result"  # a call's result, or its error
    BUNDLE: Final = "bundle"  # the replies of many ranks to one call, gathered along a reply tree
    BYE: Final = "bye"  # closed, or the error that closing raised
