"""The controller's side of the MPI world: sends calls, gathers replies, watches the workers.

Everything the pipeline does with workers goes through ``Controller.submit`` and
``Controller.wait``. Waiting is where failures surface: an error reply from any worker (not only
the awaited ones), a worker whose sideband connection dropped, or a wait past its time limit,
which first dumps the stacks of all ranks to the run's logs. A call to many ranks
(``reply_tree_min_ranks``) has its replies come back as a few bundles along a reply tree
(rollhpc.transport.reply_tree) instead of a message per rank.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollhpc.controller.errors import CallTimeout, WorkerDied, WorkerError
from rollhpc.controller.failure import is_watchdog_abort
from rollhpc.rundir import RunPaths, atomic_write_text
from rollhpc.transport.envelope import Kind
from rollhpc.transport.mpi_channel import (
    FANOUT_MIN_BYTES,
    TAG_CALL,
    TAG_REPLY,
    Backoff,
    Encoded,
    MpiChannel,
)
from rollhpc.transport.reply_tree import Bundle, build_reply_tree
from rollhpc.transport.sideband import ControllerSideband, format_all_stacks

log = logging.getLogger("rollhpc.controller")

_LIVENESS_CHECK_S = 0.02
# how long a worker whose connection closed during shutdown may take to deliver its bye
_BYE_GRACE_S = 2.0


@dataclass(frozen=True)
class RankInfo:
    rank: int
    role: str
    group_rank: int
    host: str
    pid: int

    def describe(self) -> str:
        return f"rank {self.rank} (role {self.role!r}, group rank {self.group_rank}, pid {self.pid} on {self.host})"


def _tail(path: Path, nbytes: int = 16384) -> str:
    """The end of a rank's log ("" when unreadable): what it said last before it died."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def first_missing(keys: list[tuple[int, int]], inbox: dict, start: int = 0) -> int:
    """The index of the first key from ``start`` on without its reply, or len(keys). ``Controller.wait`` carries
    it from one look to the next, so a call's keys are looked at once each in all: asking ``all(k in inbox ...)``
    from the start after every message would be O(N) per reply, O(N^2) per call when replies come back in the
    order the call went out, the usual one (bench/reply_scan.py measures it)."""
    n = len(keys)
    while start < n and keys[start] in inbox:
        start += 1
    return start


@dataclass
class _Outstanding:
    method: str
    sent_at: float


class Controller:
    def __init__(
        self,
        channel: MpiChannel,
        sideband: ControllerSideband,
        ranks: dict[int, RankInfo],
        run_dir: Path,
        call_timeout_s: float,
        stack_dump_timeout_s: float,
        reply_tree_min_ranks: int = 0,
        reply_fan_in: int = 16,
    ):
        self.channel = channel
        self.sideband = sideband
        self.ranks = ranks
        self.run_dir = run_dir
        self.call_timeout_s = call_timeout_s
        self.stack_dump_timeout_s = stack_dump_timeout_s
        self._ids = itertools.count(1)
        self._inbox: dict[tuple[int, int], object] = {}  # (rank, call id) -> the reply's value
        self._outstanding: dict[tuple[int, int], _Outstanding] = {}
        self._next_liveness = 0.0
        self._closing = False  # shutdown sent: a worker leaves right after its bye
        # a call to reply_tree_min_ranks or more has its replies collected along a tree of this fan-in (0: never)
        self.reply_tree_min_ranks = reply_tree_min_ranks
        self.reply_fan_in = reply_fan_in
        self._trees: dict[
            tuple[int, ...], int
        ] = {}  # the ranks of a call -> the id of their reply tree
        self.messages_taken = 0  # reply messages taken from MPI (a bundle counts once)
        # with count_work on (bench/scale.py): this thread's CPU seconds in sending calls and in taking replies
        # (receive, decode, bookkeeping), apart from the polls that found nothing: rank 0's own work per call,
        # whatever the wait. Off by default: the clock costs ~0.4 us, at every poll of a wait
        self.count_work = False
        self.send_cpu_s = 0.0
        self.reply_cpu_s = 0.0
        # per rank: seconds inside calls, summed (from its replies)
        self.call_s = {rank: 0.0 for rank in ranks}
        # per rank: its process's CPU seconds at its last reply
        self.cpu_s = {rank: 0.0 for rank in ranks}

    def log_path(self, rank: int) -> Path:
        return RunPaths(self.run_dir).logs / f"rank{rank}-{self.ranks[rank].role}.log"

    # -- sending -----------------------------------------------------------------------------
    def submit(self, method: str, payloads: dict[int, Encoded]) -> list[tuple[int, int]]:
        """Send ``method`` to each rank with its encoded (args, kwargs); returns the reply keys. A worker found
        gone first fails the call: a send to a dead rank can hang inside MPI (OFI's tcp provider retries the
        connection forever), where no liveness check runs."""
        self._check_liveness()
        started = time.thread_time() if self.count_work else 0.0
        call_id = next(self._ids)
        now = time.monotonic()
        envelope = self._envelope(call_id, method, list(payloads))
        by_payload: dict[
            int, tuple[Encoded, list[int]]
        ] = {}  # a one-to-all call: one payload for every rank
        for rank, enc in payloads.items():
            by_payload.setdefault(id(enc), (enc, []))[1].append(rank)
        for enc, ranks in by_payload.values():
            self.channel.send_to_each(ranks, TAG_CALL, envelope, enc)
        keys = []
        for rank in payloads:
            self._outstanding[(rank, call_id)] = _Outstanding(method, now)
            keys.append((rank, call_id))
        if self.count_work:
            self.send_cpu_s += time.thread_time() - started
        return keys

    def submit_fanout(self, method: str, role: str, enc: Encoded) -> list[tuple[int, int]]:
        """``method`` with the same (args, kwargs) to every rank of ``role``, its buffers sent once: written
        into a shared-memory file every rank maps (a role on this machine, ``MpiChannel.send_shared``) or
        broadcast (``MpiChannel.send_fanout``), instead of sent to each rank in turn."""
        self._check_liveness()
        call_id = next(self._ids)
        now = time.monotonic()
        ranks = self.channel.shared_ranks.get(role) or self.channel.fanout_ranks[role]
        envelope = self._envelope(call_id, method, ranks)
        if role in self.channel.shared_ranks:
            # no room: one copy per rank
            if not self.channel.send_shared(role, TAG_CALL, envelope, enc):
                log.warning(
                    "a %.0f MiB one-to-all payload for role %r did not fit in shared memory; sending "
                    "it to each rank",
                    sum(m.nbytes for m in enc.buffers) / 2**20,
                    role,
                )
                return self.submit(method, {rank: enc for rank in ranks})
        else:
            self.channel.send_fanout(role, TAG_CALL, envelope, enc)
        for rank in ranks:
            self._outstanding[(rank, call_id)] = _Outstanding(method, now)
        return [(rank, call_id) for rank in ranks]

    def _envelope(self, call_id: int, method: str, ranks: list[int]) -> dict[str, Any]:
        envelope: dict[str, Any] = {"kind": Kind.CALL, "call_id": call_id, "method": method}
        if (tree := self._reply_tree(ranks)) is not None:
            envelope["tree"] = tree
        return envelope

    def _reply_tree(self, ranks: list[int]) -> int | None:
        """The id of the reply tree over ``ranks`` (rollhpc.transport.reply_tree), described to each of them the
        first time; None when the call goes to fewer than ``reply_tree_min_ranks`` (each replies itself)."""
        if not self._along_tree(len(ranks)):
            return None
        key = tuple(ranks)
        tree_id = self._trees.get(key)
        if tree_id is None:
            tree = build_reply_tree(
                ranks, {r: self.ranks[r].host for r in ranks}, self.reply_fan_in
            )
            tree_id = self._trees[key] = len(self._trees) + 1
            # sent before the call, on the same tag: each rank has its place before the call that names it
            self.channel.send_each(
                TAG_CALL,
                {
                    r: {
                        "kind": Kind.TREE,
                        "tree": tree_id,
                        "parent": tree.parent[r],
                        "children": tree.children.get(r, ()),
                    }
                    for r in ranks
                },
            )
            log.info(
                "replies of calls to %d ranks go along a tree: %d messages to the controller, depth %d",
                len(ranks),
                sum(1 for p in tree.parent.values() if p == 0),
                tree.depth(),
            )
        return tree_id

    def _along_tree(self, n: int) -> bool:
        """Whether the replies of a call to ``n`` ranks come along a reply tree."""
        return bool(self.reply_tree_min_ranks) and n >= max(self.reply_tree_min_ranks, 2)

    def fans_out(self, role: str, ranks: list[int], enc: Encoded) -> bool:
        """Whether a one-to-all call to ``ranks`` sends its buffers once (shared memory or broadcast): all of a
        role's ranks (two or more), and a payload large enough that N copies cost more."""
        whole = self.channel.shared_ranks.get(role) or self.channel.fanout_ranks.get(role)
        return (
            len(ranks) > 1
            and sorted(ranks) == whole
            and sum(m.nbytes for m in enc.buffers) >= FANOUT_MIN_BYTES
        )

    def load(self) -> dict[str, tuple[float, float, int]]:
        """Per role, (seconds its ranks spent inside calls, CPU seconds of their processes, ranks), summed over
        the role's ranks as of their last replies; "controller": its own CPU seconds. Differences between two
        readings are a stage's load (``rollhpc.controller.run_loop``: per-role busy fraction and cores used)."""
        out: dict[str, tuple[float, float, int]] = {"controller": (0.0, time.process_time(), 1)}
        for rank, info in self.ranks.items():
            call, cpu, n = out.get(info.role, (0.0, 0.0, 0))
            out[info.role] = (call + self.call_s[rank], cpu + self.cpu_s[rank], n + 1)
        return out

    def remove_shared_files(self) -> None:
        """The run ends (normally or not): the shared-memory files of one-to-all payloads are removed."""
        self.channel.segments.remove_all()

    # -- receiving ---------------------------------------------------------------------------
    def _raise_worker_error(self, rank: int, err: dict[str, Any]) -> None:
        info = self.ranks[rank]
        summary = (
            f"worker {info.describe()} raised {err['type']} in {err['method']!r}: {err['message']}"
            f" (log: {self.log_path(rank)})"
        )
        raise WorkerError(
            summary,
            err["traceback"],
            role=info.role,
            method=err["method"],
            err_type=err["type"],
            message=err["message"],
        )

    def _check_liveness(self) -> None:
        for rank in self.sideband.dead_ranks():
            if self._closing and self._bye_arrives(rank):
                continue
            raise self._died(rank)

    def _died(self, rank: int) -> WorkerDied:
        info = self.ranks[rank]
        running = [(k, o) for k, o in self._outstanding.items() if k[0] == rank]
        method = ""
        if running:
            (_, cid), o = running[0]
            method = o.method
            doing = (
                f"while running {o.method!r} (call {cid}, {time.monotonic() - o.sent_at:.1f} s in)"
            )
        else:
            doing = "while idle"
        if is_watchdog_abort(_tail(self.log_path(rank))):
            return WorkerDied(
                f"worker {info.describe()} died {doing}: NCCL's watchdog ended it (a collective past "
                f"its timeout: a peer that is gone or stuck, not necessarily its own node); see "
                f"{self.log_path(rank)}",
                host=info.host,
                role=info.role,
                method=method,
                collective_timeout=True,
            )
        return WorkerDied(
            f"worker {info.describe()} died {doing}: its process is gone (killed, crashed in native code, "
            f"or its node was lost); see {self.log_path(rank)}",
            host=info.host,
            role=info.role,
            method=method,
        )

    def dead_worker(self, settle_s: float = 0.0) -> WorkerDied | None:
        """A worker found gone within ``settle_s``, by its sideband connection alone: no MPI call, so another
        thread may ask while the main one is stuck inside MPI (rollhpc.controller.mpi_stall)."""
        deadline = time.monotonic() + settle_s
        while True:
            if dead := self.sideband.dead_ranks():
                return self._died(dead[0])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _bye_arrives(self, rank: int, grace_s: float = _BYE_GRACE_S) -> bool:
        """Whether ``rank``'s bye comes within ``grace_s``: a worker exits right after sending it, and its
        sideband connection can close before the bye has crossed MPI (OFI's tcp delivers later than UCX)."""
        deadline = time.monotonic() + grace_s
        while (rank, 0) not in self._inbox:
            if time.monotonic() > deadline:
                return False
            if not self._receive():
                time.sleep(0.001)
        return True

    def pump(self) -> bool:
        """Move messages once: returns True if any reply arrived. Raises on any worker failure."""
        got = self._receive()
        now = time.monotonic()
        if now >= self._next_liveness:
            self._next_liveness = now + _LIVENESS_CHECK_S
            self._check_liveness()
        return got

    def _receive(self) -> bool:
        """Take every reply that has arrived into the inbox; True if any did. Raises a worker's error."""
        started = time.thread_time() if self.count_work else 0.0
        self.channel.progress()
        got = False
        while (msg := self.channel.poll(TAG_REPLY)) is not None:
            got = True
            self.messages_taken += 1
            if msg.envelope["kind"] == Kind.BUNDLE:  # replies collected along a reply tree
                self._take_bundle(msg.envelope["call_id"], Bundle.decode(msg.envelope, msg.payload))
            else:
                self._take(msg.source, msg.envelope, msg.payload)
        if got and self.count_work:
            self.reply_cpu_s += time.thread_time() - started
        return got

    def _take_bundle(self, call_id: int, bundle: Bundle) -> None:
        """The replies of a bundle into the inbox: ``_take``'s work for plain results (a bundle has no errors: a
        rank sends those itself), per rank only what filing its result needs."""
        for rank, result, in_call, cpu in zip(
            bundle.ranks, bundle.results, bundle.call_s, bundle.cpu_s
        ):
            self._file(rank, call_id, result, in_call, cpu)
        for rank, paths in bundle.released.items():  # shared-memory files these ranks no longer map
            self.channel.segments.release(rank, paths)

    def _take(self, source: int, env: dict[str, Any], payload: object) -> None:
        """One rank's reply into the inbox. Replies may come in any order (one relayed, the next direct): what
        they carry beside the result adds up or only grows."""
        if "error" in env:  # the run ends: release() removes the shared-memory files still out
            self._raise_worker_error(source, env["error"])
        if env.get("released"):  # shared-memory files this rank no longer maps
            self.channel.segments.release(source, env["released"])
        self._file(
            source,
            env.get("call_id", 0),
            payload if env["kind"] == Kind.RESULT else env,
            env.get("call_s"),
            env.get("cpu_s", 0.0),
        )

    def _file(
        self, rank: int, call_id: int, value: object, in_call: float | None, cpu: float
    ) -> None:
        """A reply's value into the inbox, its call no longer outstanding, and the rank's load (``in_call``:
        seconds inside the call, None for the start-up and shutdown replies, which carry none)."""
        key = (rank, call_id)
        self._outstanding.pop(key, None)
        if in_call is not None:
            self.call_s[rank] += in_call
            if cpu > self.cpu_s[rank]:
                self.cpu_s[rank] = cpu
        self._inbox[key] = value

    def ready(self, keys: list[tuple[int, int]]) -> bool:
        """Whether every key has its reply (messages moved first, unless they are all in already)."""
        if all(k in self._inbox for k in keys):
            return True
        self.pump()
        return all(k in self._inbox for k in keys)

    def wait(
        self, keys: list[tuple[int, int]], what: str, timeout_s: float | None = None
    ) -> dict[int, object]:
        """Block until every key has its reply; returns {rank: payload}."""
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        backoff = Backoff(hot_s=0.002, max_sleep_s=0.001)
        done = 0  # keys[:done] have their replies (a reply stays in the inbox until this wait takes it)
        while (done := first_missing(keys, self._inbox, done)) < len(keys):
            if self.pump():
                backoff.reset()
                continue
            if time.monotonic() > deadline:
                missing = sorted(r for r, c in keys if (r, c) not in self._inbox)
                self._timeout(what, missing, limit, self._along_tree(len(keys)))
            backoff.wait()
        return {rank: self._inbox.pop((rank, cid)) for rank, cid in keys}

    def _timeout(self, what: str, missing: list[int], limit: float, relayed: bool = False) -> None:
        stacks = self.sideband.collect_stacks(self.stack_dump_timeout_s)
        path = RunPaths(self.run_dir).logs / f"stacks-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        parts = [f"=== rank 0 (controller) ===\n{format_all_stacks()}"]
        for rank in sorted(stacks):
            parts.append(f"=== {self.ranks[rank].describe()} ===\n{stacks[rank]}")
        atomic_write_text(path, "\n".join(parts))
        who = ", ".join(self.ranks[r].describe() for r in missing)
        through = (
            (
                " (the replies come along a reply tree: a rank named may have answered, its relay not yet; a relay "
                "waiting on its children shows ReplyRouter._collect in its stack)"
            )
            if relayed
            else ""
        )
        raise CallTimeout(
            f"{what}: no reply within {limit:g} s from {who}{through}; stacks of all ranks: {path}"
        )

    def root_cause(self, exc: BaseException, settle_s: float = 1.0) -> BaseException:
        """An interrupt or odd error on the controller is often the echo of a worker's death (some
        launchers interrupt every rank when one dies): if a worker is gone, that is the cause."""
        deadline = time.monotonic() + settle_s
        while True:
            try:
                self._check_liveness()
            except WorkerDied as died:
                return died
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.05)

    def build(self, ranks: list[int]) -> None:
        """Tell these ranks to build their workers (each answers "ready" as call 0: ``wait``)."""
        self.channel.send_each(TAG_CALL, {r: {"kind": Kind.BUILD} for r in ranks})

    # -- ending ------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float) -> None:
        """Normal end: every worker closes its role and leaves its loop."""
        keys = []
        self._closing = True
        for rank in self.ranks:
            self.channel.send(rank, TAG_CALL, {"kind": Kind.SHUTDOWN})
            keys.append((rank, 0))
        self.wait(keys, "shutdown", timeout_s)
        self.channel.flush(timeout_s)
        self.remove_shared_files()
        self.sideband.close()

    def release(self, wait_s: float = 3.0) -> bool:
        """Failure end: make every worker exit now; True if all connections closed in time."""
        try:
            return self.sideband.release_workers(wait_s)
        finally:
            self.remove_shared_files()
            self.sideband.close()
