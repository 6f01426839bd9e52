"""The controller's verdict on a failure (rollhpc.controller.failure): which error is the echo of a lost node,
which is a lost peer, which is the run's own; decided in a bounded look, not by which error came first.

The liveness probes are plain functions here; the real ones (sideband, Slurm's node states) are exercised by
the chaos tests on the local Slurm (tests/world/test_requeue.py)."""

from __future__ import annotations

import json
import time

import pytest

from rollhpc.controller.errors import CallTimeout, WorkerDied, WorkerError
from rollhpc.controller.failure import Failure, StalledCall, classify, is_communication_error
from rollhpc.rundir.failure_kind import FailureKind

LOST_WORKER, LOST_PEER, ERROR = FailureKind.LOST_WORKER, FailureKind.LOST_PEER, FailureKind.ERROR

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:60044"
)


def gen_error(message: str = GLOO_RESET, err_type: str = "RuntimeError") -> WorkerError:
    return WorkerError(
        f"worker rank 1 (role 'generate') raised {err_type} in 'receive_weights': {message}",
        "Traceback ...",
        role="generate",
        method="receive_weights",
        err_type=err_type,
        message=message,
    )


def test_communication_errors_are_recognised_by_type_and_message_only():
    assert is_communication_error("RuntimeError", GLOO_RESET)
    assert is_communication_error(
        "RuntimeError",
        "[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:1234: Connection reset by peer",
    )
    assert is_communication_error(
        "DistBackendError",
        "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process "
        "exited or there was a network error",
    )
    assert is_communication_error("DistNetworkError", "failed to recv, got 0 bytes")
    assert not is_communication_error("ValueError", "reward function returned None for sample 3")
    assert not is_communication_error("KeyError", "'answer'")


def test_a_comm_error_while_a_worker_is_dead_is_that_workers_loss():
    """The generator's gloo error arrives first; the trainer's death shows a moment later: a lost worker on
    the trainer's node (its host to exclude), the generator's error named as the echo."""
    t0 = time.monotonic()
    dead = WorkerDied(
        "worker rank 3 (role 'train') died while running 'broadcast_weights'",
        host="node2",
        role="train",
        method="broadcast_weights",
    )

    def dead_worker() -> WorkerDied | None:
        return dead if time.monotonic() - t0 > 0.3 else None

    exc, verdict = classify(gen_error(), dead_worker, lambda: [], settle_s=5.0, step=5)
    assert verdict.kind == LOST_WORKER and verdict.hosts == ["node2"] and verdict.restartable
    assert isinstance(exc, WorkerDied) and exc.host == "node2"
    assert "its echo" in exc.summary and "receive_weights" in verdict.cause
    assert verdict.signature == "lost_worker|train|broadcast_weights|||5", (
        "the same crash again would repeat it"
    )
    assert time.monotonic() - t0 < 2.0, (
        "decided as soon as the death was seen, not after the whole look"
    )


def test_slurm_saying_a_node_is_down_is_a_lost_worker_too():
    exc, verdict = classify(
        gen_error(), lambda: None, lambda: ["node4"], lambda h: ["rank 2 train"], settle_s=5.0
    )
    assert verdict.kind == LOST_WORKER and verdict.hosts == ["node4"]
    assert "node4 (rank 2 train) of the run is down or not responding" in exc.summary


def test_a_comm_error_with_nobody_dead_is_a_lost_peer_after_a_full_look():
    t0 = time.monotonic()
    exc, verdict = classify(gen_error(), lambda: None, lambda: [], settle_s=0.5, step=7)
    assert time.monotonic() - t0 >= 0.5
    assert verdict.kind == LOST_PEER and verdict.restartable and verdict.hosts == []
    assert verdict.signature.startswith(
        "lost_peer|generate|receive_weights|RuntimeError|"
    ) and verdict.signature.endswith("|7")
    # the same failure again, from another port and pid, has the same signature: deterministic if it repeats
    _, again = classify(
        gen_error(GLOO_RESET.replace("60044", "41999").replace("553", "553")),
        lambda: None,
        lambda: [],
        settle_s=0.0,
        step=7,
    )
    assert again.signature == verdict.signature
    _, later = classify(gen_error(), lambda: None, lambda: [], settle_s=0.0, step=8)
    assert later.signature != verdict.signature, "at another step it is another occurrence"


def test_timeouts_and_stalls_are_lost_peers():
    for exc in (
        CallTimeout("train_step: no reply within 900 s from rank 3"),
        StalledCall("an MPI call on the controller has not returned for 30 s"),
    ):
        _, verdict = classify(exc, lambda: None, lambda: [], settle_s=0.0)
        assert verdict.kind == LOST_PEER, exc


def test_an_error_of_the_runs_own_code_ends_the_run_whatever_dies_after_it():
    """A constructor that raises (lr=-1) takes its peers down with it: their deaths are its consequence."""
    t0 = time.monotonic()
    exc = gen_error("reward function returned None for sample 3", "ValueError")
    peer = WorkerDied(
        "worker rank 2 (role 'train') died while running '__init__'",
        host="node1",
        role="train",
        method="__init__",
    )
    same, verdict = classify(exc, lambda: peer, lambda: ["node1"], settle_s=30.0, step=2)
    assert time.monotonic() - t0 < 1.0, "a plain error waits no communication error's look"
    assert same is exc and verdict.kind == ERROR and not verdict.restartable
    assert verdict.record()["summary"].startswith(
        "worker rank 1 (role 'generate') raised ValueError"
    )


def test_a_worker_lost_idle_or_by_slurms_word_is_never_a_repeat():
    """Only a death inside a call can repeat as the run's own crash: an idle reward rank's node lost at step 6,
    then another one's after the restart at step 6 again, are two losses (chaos on 16 nodes ended such a run)."""
    idle = WorkerDied("worker rank 4 (role 'reward') died while idle", host="node10", role="reward")
    _, verdict = classify(idle, lambda: None, lambda: [], step=6)
    assert verdict.kind == LOST_WORKER and verdict.hosts == ["node10"] and verdict.signature == ""
    _, verdict = classify(gen_error(), lambda: None, lambda: ["node4"], settle_s=5.0, step=6)
    assert verdict.kind == LOST_WORKER and verdict.signature == ""
    busy = WorkerDied(
        "worker rank 3 (role 'train') died while running 'train_step'",
        host="node2",
        role="train",
        method="train_step",
    )
    assert (
        classify(busy, lambda: None, lambda: [], step=6)[1].signature
        == "lost_worker|train|train_step|||6"
    )


WATCHDOG_LOG = """[rank3]:[E1128 10:02:11.51 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout:
WorkNCCL(SeqNum=812, OpType=BROADCAST, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for 600091
milliseconds before timing out.
[rank3]:[E1128 10:02:11.52 ProcessGroupNCCL.cpp:1664] [PG ID 2 PG GUID 3 Rank 1] To avoid data inconsistency, we are
taking the entire process down."""


def test_a_rank_ended_by_nccls_watchdog_is_a_lost_peer_not_a_bad_node():
    """The rank waited on a peer in a collective until the watchdog took it down: which node is at fault is
    unknown, and excluding this (healthy) one would shrink the pool of a run that restarts for weeks."""
    from rollhpc.controller.failure import is_watchdog_abort

    assert is_watchdog_abort(WATCHDOG_LOG) and not is_watchdog_abort(
        "Segmentation fault (core dumped)"
    )
    died = WorkerDied(
        "worker rank 3 (role 'generate') died while running 'receive_weights': NCCL's watchdog ended "
        "it",
        host="node2",
        role="generate",
        method="receive_weights",
        collective_timeout=True,
    )
    exc, verdict = classify(died, lambda: None, lambda: [], settle_s=5.0, step=7)
    assert verdict.kind == LOST_PEER and verdict.hosts == [] and verdict.restartable
    # found dead while another rank's communication error is classified: the same
    t0 = time.monotonic()
    exc, verdict = classify(gen_error(), lambda: died, lambda: [], settle_s=5.0, step=7)
    assert verdict.kind == LOST_PEER and verdict.hosts == [] and time.monotonic() - t0 < 1.0


OLDER_RUNS_WROTE = [
    "lost_worker",
    "lost_peer",
    "world_not_formed",
    "error",
    "interrupted",
    "placement",
]


@pytest.mark.parametrize("value", OLDER_RUNS_WROTE)
def test_each_failure_kind_reads_back_from_the_string_older_runs_wrote(value: str):
    """controller-exit.json and restarts.jsonl of runs recorded before the enum hold these plain strings."""
    kind = FailureKind.of(value)
    assert kind is not None and kind == value and kind.description and str(kind) == value


def test_a_verdict_writes_the_same_json_as_a_plain_string_kind():
    verdict = Failure(FailureKind.LOST_PEER, "gloo: reset", signature="lost_peer|x", step=3)
    plain = {"kind": "lost_peer", "summary": "gloo: reset", "signature": "lost_peer|x", "step": 3}
    assert json.dumps(verdict.record()) == json.dumps(plain)
    assert json.dumps(verdict.record(), indent=1) == json.dumps(plain, indent=1)


def test_an_unknown_kind_is_none_and_only_node_or_network_faults_restart():
    assert FailureKind.of("meteor") is None and FailureKind.of(None) is None
    assert {k for k in FailureKind if k.restartable} == {
        LOST_WORKER,
        LOST_PEER,
        FailureKind.WORLD_NOT_FORMED,
    }
    assert FailureKind.ERROR.requeue_says("ValueError: {bad}").endswith(": ValueError: {bad}")
    assert FailureKind.INTERRUPTED.requeue_says("SIGTERM") == ""
