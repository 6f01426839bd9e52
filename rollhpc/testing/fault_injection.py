"""Fault injection for the tests of checkpoint-and-requeue: every test hook of the product, in one place.

Each hook does nothing unless its environment variable is set; the product calls it at one named point.
A requeued Slurm job inherits its environment, so each hook says on which attempts it acts.

    ROLLHPC_TEST_CHECKPOINT_DELAY=STEP:SECONDS      hold the commit of checkpoint STEP (its files written, not
                                                    sealed): a run killed meanwhile has a half-written
                                                    checkpoint; the time-limit warning finds the run mid-way.
                                                    Only before the run's first restart.
    ROLLHPC_TEST_HOLD_AFTER_CHECKPOINT=STEP:SECONDS hold the controller once checkpoint STEP is committed: a
                                                    node can die after a run's last step, before its end.
    ROLLHPC_TEST_STALL_MPI_INIT=N[:PHASE]           world rank N stalls before MPI_Init (PHASE mpi_init, the
                                                    default), before the first collective (collectives), or
                                                    before MPI_Init with SIGTERM, SIGINT and SIGHUP ignored
                                                    (deaf: a rank blocked in C whose handler never runs).
                                                    Only on a Slurm job's first attempt.

    ROLLHPC_TEST_HOLD_IN_WEIGHT_SYNC=N:SECONDS[:A]   hold the sender of the N-th broadcast weight sync of this
                                                    process half-way (its first header sent, the receivers
                                                    blocked in the collective): a node can die mid-sync.
                                                    Only in the run's attempt A (default 0: before its first
                                                    restart).
    ROLLHPC_TEST_HOLD_IN_GRAD_SYNC=N:SECONDS         hold the trainer's last data-parallel rank before its
                                                    gradient all-reduce of its N-th train call (the others
                                                    wait inside theirs). Only before the run's first restart.
    ROLLHPC_TEST_CORRUPT_WEIGHT_SYNC=N               the sender of the N-th weight sync of this process flips a
                                                    bit of its first bucket after stamping it (verify after
                                                    sync must catch it), as a stream race on a GPU would.

The checkpoint holds end early once RUN_DIR/stop-request exists (the time-limit warning), and keep watching the
workers meanwhile (``watch``: the controller's liveness check), as the real waits they stand in for do: a
worker that dies during a hold is noticed at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rollhpc.proc.attempt import restart_number

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rollhpc.testing.fault_injection")

CHECKPOINT_DELAY = "ROLLHPC_TEST_CHECKPOINT_DELAY"
HOLD_AFTER_CHECKPOINT = "ROLLHPC_TEST_HOLD_AFTER_CHECKPOINT"
STALL_MPI_INIT = "ROLLHPC_TEST_STALL_MPI_INIT"
HOLD_IN_WEIGHT_SYNC = "ROLLHPC_TEST_HOLD_IN_WEIGHT_SYNC"
HOLD_IN_GRAD_SYNC = "ROLLHPC_TEST_HOLD_IN_GRAD_SYNC"
CORRUPT_WEIGHT_SYNC = "ROLLHPC_TEST_CORRUPT_WEIGHT_SYNC"


Watch = Callable[[], object]


def _hold(variable: str, step: int, stop_file: Path, watch: Watch, what: str) -> None:
    at, _, seconds = os.environ.get(variable, "").partition(":")
    if not at or int(at) != step:
        return
    log.warning("%s: %s for %s s", variable, what, seconds)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not stop_file.exists():
        watch()
        time.sleep(0.2)


def checkpoint_commit(step: int, restarts: int, stop_file: Path, watch: Watch) -> None:
    """Called with checkpoint ``step``'s files written, before its commit."""
    if not restarts:
        _hold(CHECKPOINT_DELAY, step, stop_file, watch, f"holding the commit of step {step} back")


def checkpoint_committed(step: int, stop_file: Path, watch: Watch) -> None:
    """Called once checkpoint ``step`` is committed, before the run goes on (or ends)."""
    _hold(
        HOLD_AFTER_CHECKPOINT,
        step,
        stop_file,
        watch,
        f"holding the controller after checkpoint {step}",
    )


def mpi_stall(where: str) -> None:
    """Called by every rank before MPI_Init (``where="mpi_init"``) and before its first collective
    (``"collectives"``): stalls the rank ROLLHPC_TEST_STALL_MPI_INIT names, on a first attempt only."""
    rank, _, phase = os.environ.get(STALL_MPI_INIT, "").partition(":")
    me = os.environ.get("SLURM_PROCID") or os.environ.get("PMI_RANK")
    if not rank or rank != me or restart_number() != 0:
        return
    if phase == "deaf":
        if where != "mpi_init":
            return
        # process-wide: a mask is per thread
        for signum in (
            signal.SIGTERM,
            signal.SIGINT,
            signal.SIGHUP,
        ):
            signal.signal(signum, signal.SIG_IGN)
    elif (phase or "mpi_init") != where:
        return
    # tests wait for this line (the job's output) before they act
    print(
        f"{STALL_MPI_INIT}: rank {rank} stalls before {where}{' (deaf to signals)' if phase == 'deaf' else ''}",
        file=sys.stderr,
        flush=True,
    )
    time.sleep(3600)


def _hold_in_collective(variable: str, nth: int, what: str) -> None:
    at, _, rest = os.environ.get(variable, "").partition(":")
    seconds, _, attempt = rest.partition(":")
    if not at or int(at) != nth or restart_number() != int(attempt or 0):
        return
    # tests wait for it
    print(f"{variable}: holding {what} {nth} for {seconds} s", file=sys.stderr, flush=True)
    time.sleep(float(seconds))


def in_weight_sync(nth: int) -> None:
    """Called by the weight-sync sender after the first header of its ``nth`` sync (1-based, per process)."""
    _hold_in_collective(HOLD_IN_WEIGHT_SYNC, nth, "the weight sync")


def corrupt_weight_sync(nth: int, bucket: int, data: torch.Tensor) -> None:
    """Called by a weight-sync sender with each bucket's data once it is stamped: on the ``nth`` sync, the first
    bucket gets its lowest bit of its first byte flipped."""
    if bucket != 0 or os.environ.get(CORRUPT_WEIGHT_SYNC, "") != str(nth):
        return
    import torch  # only when the hook acts: the product imports this module on the login node too

    raw = data.view(-1).view(torch.uint8)
    raw[0] ^= 1
    print(
        f"rollhpc test hook: corrupted the first bucket of weight sync {nth}",
        file=sys.stderr,
        flush=True,
    )


def before_grad_sync(nth: int) -> None:
    """Called by the trainer's last data-parallel rank before the gradient all-reduce of its ``nth`` train call."""
    _hold_in_collective(HOLD_IN_GRAD_SYNC, nth, "the gradient all-reduce of train call")
