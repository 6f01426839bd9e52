"""A worker rank's life: build the role's worker, then execute the controller's calls in order.

Exceptions in a call do not end the loop: they go back to the controller as an error reply with
the rank, role and traceback, and the controller decides (by default it ends the run).
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from rollhpc.proc.startup_gc import startup_gc
from rollhpc.protocol.worker import Worker, WorkerContext
from rollhpc.transport.envelope import Kind
from rollhpc.transport.mpi_channel import (
    TAG_CALL,
    TAG_REPLY,
    Backoff,
    Encoded,
    Message,
    MpiChannel,
)
from rollhpc.transport.sideband import WorkerSideband
from rollhpc.workers.reply_relay import ReplyRouter

log = logging.getLogger("rollhpc.worker")

CONTROLLER_RANK = 0


def _error(exc: BaseException, ctx: WorkerContext, method: str) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "method": method,
        "role": ctx.role,
        "group_rank": ctx.group_rank,
    }


def _next_message(channel: MpiChannel, backoff: Backoff) -> Message:
    """The controller's next message to this rank, waiting for it (progressing MPI, backing off while idle)."""
    while True:
        msg = channel.poll(TAG_CALL, source=CONTROLLER_RANK)
        if msg is not None:
            backoff.reset()
            return msg
        channel.progress()
        backoff.wait()


def _await_build(channel: MpiChannel) -> bool:
    """Wait for the controller's word to build (roles sharing GPUs build in turns: rollhpc.controller.startup);
    False: the run shuts down before this rank's turn (acknowledged here)."""
    kind = _next_message(channel, Backoff()).envelope["kind"]
    if kind == Kind.BUILD:
        return True
    if kind == Kind.SHUTDOWN:
        channel.send(CONTROLLER_RANK, TAG_REPLY, {"kind": Kind.BYE})
        channel.flush(60)
        return False
    raise RuntimeError(f"a {kind!r} message before the worker was built")


def serve(
    channel: MpiChannel,
    sideband: WorkerSideband,
    worker_cls: type[Worker],
    ctx: WorkerContext,
    options: object,
) -> None:
    """Build the role's worker when the controller says so, then answer its calls until it shuts us down."""
    if not _await_build(channel):
        return
    worker = _build(channel, worker_cls, ctx, options)
    if worker is None:
        return
    replies = ReplyRouter(channel, ctx.world_rank)
    backoff = Backoff()
    while _serve_next(channel, sideband, replies, worker, ctx, backoff):
        pass


def _build(
    channel: MpiChannel, worker_cls: type[Worker], ctx: WorkerContext, options: object
) -> Worker | None:
    """The worker, its construction times sent to the controller; None when it failed (the error sent)."""
    try:
        started = time.time()
        with startup_gc():  # construction is mostly imports: see rollhpc.proc.startup_gc
            worker = worker_cls(ctx, options)
        channel.send(
            CONTROLLER_RANK, TAG_REPLY, {"kind": Kind.READY, "built": [started, time.time()]}
        )
        return worker
    except BaseException as e:  # noqa: BLE001 - reported to the controller, which ends the run
        log.exception("constructing %s failed", worker_cls.__name__)
        channel.send(
            CONTROLLER_RANK, TAG_REPLY, {"kind": Kind.READY, "error": _error(e, ctx, "__init__")}
        )
        channel.flush(60)
        return None


def _close(channel: MpiChannel, worker: Worker, ctx: WorkerContext) -> None:
    """A normal shutdown: the worker's ``close``, then goodbye (with its error, if it raised)."""
    try:
        worker.close()
        channel.send(CONTROLLER_RANK, TAG_REPLY, {"kind": Kind.BYE})
    except BaseException as e:  # noqa: BLE001
        channel.send(
            CONTROLLER_RANK, TAG_REPLY, {"kind": Kind.BYE, "error": _error(e, ctx, "close")}
        )
    channel.flush(60)


def _serve_next(
    channel: MpiChannel,
    sideband: WorkerSideband,
    replies: ReplyRouter,
    worker: Worker,
    ctx: WorkerContext,
    backoff: Backoff,
) -> bool:
    """Take the controller's next message and act on it; False once it was the shutdown."""
    msg = _next_message(channel, backoff)
    env = msg.envelope
    if env["kind"] == Kind.SHUTDOWN:
        sideband.closing = True
        _close(channel, worker, ctx)
        return False
    if env["kind"] == Kind.TREE:  # where this rank's replies to the calls naming this tree go
        replies.learn(env)
        return True
    args, kwargs = msg.payload
    reply, result = _call(worker, ctx, env, args, kwargs)
    # a shared-memory payload nothing else holds is unmapped now, and said so in the reply
    del msg, args, kwargs
    _send_result(channel, replies, ctx, env, reply, result)
    return True


def _call(
    worker: Worker, ctx: WorkerContext, env: dict[str, Any], args: tuple, kwargs: dict
) -> tuple[dict[str, Any], object]:
    """Run the call ``env`` names: its reply so far (the error, if it raised) and its result."""
    reply: dict[str, Any] = {"kind": Kind.RESULT, "call_id": env["call_id"]}
    started = time.perf_counter()
    try:
        result = getattr(worker, env["method"])(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001
        log.exception("call %s failed", env["method"])
        reply["error"] = _error(e, ctx, env["method"])
        result = None
    # what the controller's per-role load metrics read (Controller.load): seconds inside this call, and
    # this process's CPU seconds so far (every thread: the generator's engine loop too)
    reply["call_s"], reply["cpu_s"] = time.perf_counter() - started, time.process_time()
    return reply, result


def _send_result(
    channel: MpiChannel,
    replies: ReplyRouter,
    ctx: WorkerContext,
    env: dict[str, Any],
    reply: dict[str, Any],
    result: object,
) -> None:
    """The call's reply and result, encoded, to the controller (or up the call's reply tree)."""
    try:
        encoded = Encoded.of(result)
    except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be pickled
        reply["error"] = _error(
            TypeError(f"the result of {env['method']} cannot be sent: {e}"), ctx, env["method"]
        )
        encoded = Encoded.of(None)
    if channel.released:
        reply["released"] = channel.take_released()
    replies.send(env, reply, encoded, result)
