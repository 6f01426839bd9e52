"""A TCP connection from every worker to the controller, beside MPI, for what MPI cannot do.

- Liveness: when a worker process dies its kernel closes the socket, so the controller learns of it
  at once (TCP keepalive covers a whole node going silent). MPI alone would just wait forever.
- Orphan prevention: when the controller dies or gives up, each worker sees the socket close and
  exits, wherever it runs and whatever the launcher did.
- Stack dumps: a thread in each worker answers "DUMP" with the Python stacks of all its threads,
  even while its main thread is stuck inside a call.

The controller holds one connection per worker rank (8,769 in the largest shipped plan) and asks which closed
before every call it sends: the connections sit in an epoll set (``selectors``), so a check costs what is ready,
not a scan of every socket, and has no 1024-descriptor ceiling (``select.select`` refuses any descriptor above
1023); the process's descriptor limit is raised to what the world needs before the workers connect.
"""

from __future__ import annotations

import os
import resource
import secrets
import selectors
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

_HELLO_BYTES = 64
_DUMP = b"DUMP\n"
_EXIT = b"EXIT\n"


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def format_all_stacks() -> str:
    """Python stacks of every thread of this process."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)} ---\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    token: str


_SPARE_DESCRIPTORS = 256  # beyond one per worker connection: MPI's own, logs, files of the run


def ensure_descriptors(needed: int) -> int:
    """Raise this process's soft limit on open descriptors to at least ``needed`` (up to the hard limit);
    returns the soft limit now. A hard limit below ``needed`` is a clear error here, instead of ``accept``
    failing with EMFILE partway through a world's start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise RuntimeError(
            f"the controller holds one connection per worker rank and needs about {needed} open "
            f"descriptors, but this process may open at most {hard} (ulimit -Hn): raise the hard "
            "limit for the job (limits.conf nofile, or Slurm's PropagateResourceLimits from a "
            "shell with a higher limit)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


class ControllerSideband:
    """The controller's end: accepts one connection per worker rank and watches them."""

    def __init__(self, bind_host: str, advertise: str | None = None):
        # a backlog of the kernel's maximum: thousands of workers connect at once at a world's start
        self._server = socket.create_server((bind_host, 0), backlog=socket.SOMAXCONN)
        self._server.settimeout(1.0)
        self.address = Address(
            advertise or bind_host, self._server.getsockname()[1], secrets.token_hex(8)
        )
        self._socks: dict[int, socket.socket] = {}
        self._lost: set[int] = set()
        # seen closed outside dead_ranks (by collect_stacks), not reported yet
        self._closed: set[int] = set()
        self._ready = selectors.DefaultSelector()  # every open connection; data: its rank

    def accept(self, ranks: set[int], timeout_s: float) -> None:
        ensure_descriptors(len(ranks) + _SPARE_DESCRIPTORS)
        deadline = time.monotonic() + timeout_s
        while set(self._socks) != ranks:
            if time.monotonic() > deadline:
                missing = sorted(ranks - set(self._socks))
                raise TimeoutError(
                    f"worker ranks {missing} did not connect to the controller within {timeout_s:.0f} s"
                )
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            conn.settimeout(timeout_s)
            hello = _recv_exact(conn, _HELLO_BYTES).decode(errors="replace").split()
            if len(hello) != 3 or hello[0] != "HELLO" or hello[2] != self.address.token:
                conn.close()
                continue
            _keepalive(conn)
            conn.setblocking(False)
            rank = int(hello[1])
            self._socks[rank] = conn
            self._ready.register(conn, selectors.EVENT_READ, rank)

    def _readable(self, timeout_s: float) -> list[int]:
        """Ranks whose connection has something to read (or has closed), waiting up to ``timeout_s``."""
        return (
            [key.data for key, _ in self._ready.select(timeout_s)] if self._ready.get_map() else []
        )

    def _unwatch(self, rank: int) -> None:
        """A closed connection leaves the epoll set (it would read as ready at every check after)."""
        try:
            self._ready.unregister(self._socks[rank])
        except (KeyError, ValueError):
            pass

    def _lose(self, rank: int) -> None:
        self._lost.add(rank)
        self._unwatch(rank)

    def dead_ranks(self) -> list[int]:
        """Ranks whose connection has closed since the last call (their process is gone)."""
        dead = list(self._closed)
        self._lost.update(self._closed)
        self._closed.clear()
        for rank in self._readable(0):
            try:
                data = self._socks[rank].recv(4096)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                self._lose(rank)
                dead.append(rank)
        return sorted(dead)

    def collect_stacks(self, timeout_s: float) -> dict[int, str]:
        """Ask every live worker for its stacks; ranks that do not answer in time get a note instead."""
        replies: dict[int, bytearray] = {}
        for rank, sock in self._socks.items():
            if rank in self._lost or rank in self._closed:
                continue
            try:
                sock.sendall(_DUMP)
                replies[rank] = bytearray()
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        done: dict[int, str] = {}
        while len(done) < len(replies) and time.monotonic() < deadline:
            for rank in [r for r in self._readable(0.05) if r in replies and r not in done]:
                try:
                    chunk = self._socks[rank].recv(1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    done[rank] = "(connection closed while dumping)"
                    self._unwatch(rank)
                    self._closed.add(rank)  # dead_ranks still reports it
                    continue
                replies[rank] += chunk
                head, sep, rest = bytes(replies[rank]).partition(b"\n")
                if sep and len(rest) >= int(head.split()[1]):
                    done[rank] = rest.decode(errors="replace")
        for rank in replies:
            done.setdefault(
                rank,
                f"(no answer within {timeout_s:.0f} s: the process may be stuck in native code)",
            )
        for rank in self._lost:
            done[rank] = "(process is gone)"
        return done

    def release_workers(self, wait_s: float) -> bool:
        """Tell every worker to exit and wait for their connections to close. True if all went."""
        for rank, sock in self._socks.items():
            try:
                sock.sendall(_EXIT)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._lose(rank)
        deadline = time.monotonic() + wait_s
        while len(self._lost) < len(self._socks) and time.monotonic() < deadline:
            self.dead_ranks()
            time.sleep(0.01)
        return len(self._lost) == len(self._socks)

    def close(self) -> None:
        self._ready.close()
        for sock in self._socks.values():
            sock.close()
        self._server.close()


class WorkerSideband:
    """A worker's end: a daemon thread that answers stack requests and exits the process when told
    to or when the controller disappears."""

    def __init__(self, address: Address, rank: int, on_controller_lost_exit_code: int = 70):
        self._sock = socket.create_connection((address.host, address.port), timeout=30)
        _keepalive(self._sock)
        self._sock.sendall(f"HELLO {rank} {address.token}".ljust(_HELLO_BYTES).encode())
        self._sock.settimeout(None)
        self._exit_code = on_controller_lost_exit_code
        self.closing = False  # set by a normal shutdown, so a closed socket is then expected
        threading.Thread(target=self._serve, name="rollhpc-sideband", daemon=True).start()

    def _serve(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                if self.closing:
                    return
                print(
                    "rollhpc: the controller is gone; this worker exits",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(self._exit_code)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line + b"\n" == _DUMP:
                    text = format_all_stacks().encode()
                    self._sock.sendall(f"STACKS {len(text)}\n".encode() + text)
                elif line + b"\n" == _EXIT:
                    if not self.closing:
                        print(
                            "rollhpc: the controller ended the run; this worker exits",
                            file=sys.stderr,
                            flush=True,
                        )
                        sys.stderr.flush()
                        os._exit(self._exit_code)
