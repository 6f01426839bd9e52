"""The controller's sideband at more connections than ``select`` can watch (issue 36).

The controller holds one TCP connection per worker rank; the largest shipped plan has 8,769 ranks. Here the
workers' ends are plain sockets speaking the sideband's hello (a process per rank is what bench/scale.py runs;
this test needs only the descriptors), and the controller's end is the real ``ControllerSideband``.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys

import pytest

from rollhpc.transport.sideband import _HELLO_BYTES, ControllerSideband, ensure_descriptors

N_WORKERS = 1100  # with both ends in this process, descriptors well past select's 1023


@pytest.fixture(scope="module")
def sideband_and_workers():
    try:
        ensure_descriptors(2 * N_WORKERS + 256)
    except RuntimeError as exc:  # a machine whose hard limit is below ~2,500 descriptors
        pytest.skip(str(exc))
    sideband = ControllerSideband("127.0.0.1")
    workers = {}
    for rank in range(1, N_WORKERS + 1):
        sock = socket.create_connection(("127.0.0.1", sideband.address.port))
        sock.sendall(f"HELLO {rank} {sideband.address.token}".ljust(_HELLO_BYTES).encode())
        workers[rank] = sock
        if rank % 64 == 0:  # the listen backlog: accept what has queued so far
            sideband.accept(set(workers), timeout_s=30)
    sideband.accept(set(workers), timeout_s=30)
    yield sideband, workers
    sideband.close()
    for sock in workers.values():
        sock.close()


def test_dead_ranks_found_among_more_connections_than_select_can_watch(sideband_and_workers):
    sideband, workers = sideband_and_workers
    assert max(s.fileno() for s in sideband._socks.values()) > 1023  # what select.select refuses
    assert sideband.dead_ranks() == []
    gone = [N_WORKERS, 7, 700]  # the last connected (the highest descriptor) among them
    for rank in gone:
        workers[rank].close()
    assert sideband.dead_ranks() == sorted(gone)
    assert sideband.dead_ranks() == []  # each death reported once

    # stacks: a worker that answers, one that closes while asked, the rest silent
    workers[3].sendall(b"STACKS 5\nhello")
    workers[5].close()
    stacks = sideband.collect_stacks(timeout_s=0.5)
    assert stacks[3] == "hello"
    assert stacks[5] == "(connection closed while dumping)"
    assert all(stacks[r] == "(process is gone)" for r in gone)
    assert stacks[4].startswith("(no answer within")
    assert len(stacks) == N_WORKERS
    assert sideband.dead_ranks() == [5]  # closed during the dump: still reported as dead, once
    assert sideband.dead_ranks() == []


def test_descriptor_limit_raised_or_refused_clearly():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import resource; from rollhpc.transport.sideband import ensure_descriptors as e\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))\n"
        "assert e(1500) == 1500 and resource.getrlimit(resource.RLIMIT_NOFILE) == (1500, 2048)\n"
        "try:\n    e(4000)\nexcept RuntimeError as exc:\n    print(exc)\nelse:\n    raise SystemExit('no error')\n"
    )
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine's hard descriptor limit is {hard}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (
        "needs about 4000 open descriptors" in out.stdout
        and "at most 2048 (ulimit -Hn)" in out.stdout
    )
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)  # this process untouched
