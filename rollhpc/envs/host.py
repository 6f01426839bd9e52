"""The environment host: one process per rank that imports an environment class once and forks one small process
per episode on request, so that an environment which raises, hangs or returns garbage ends its own episode and
never the rank (rollhpc.workers.env, the env role, says why and drives it).

Started fresh as ``python -P -m rollhpc.envs.host CONTROL_FD`` (it inherits neither MPI nor the rank's threads).
Here: checking what an environment returned (in the episode's process), the length-prefixed pickle framing of
the rank's sockets to the episodes, the episode process, and the host that forks, kills and reaps them.
"""

from __future__ import annotations

import gc
import logging
import math
import numbers
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rollhpc.envs import env_class, make_env
from rollhpc.proc.parent_death import die_with_parent

log = logging.getLogger(__name__)

SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
HOST_REPLY_S = 60.0  # the host answers a fork request in milliseconds; this long means it is broken
CONTROL_RECORD = 1 << 16  # the largest host control record (a pid, or an error line)


def _describe(exc: BaseException) -> str:
    """``ExceptionType: first line of the message`` (bounded), the form an episode's end reason takes."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------------------------------------------
# Checking what an environment returned (runs in the episode's process).


class _Invalid(Exception):
    """An environment returned something that breaks the protocol; the message says what."""


def _is_bool(x: object) -> bool:
    return isinstance(x, bool) or (
        type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool")
    )


def is_finite(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _info_fields(info: object) -> dict[str, Any]:
    """The ``info`` keys rollhpc reads, checked and turned into plain types."""
    if not isinstance(info, dict):
        raise _Invalid(f"info is {type(info).__name__}, not dict")
    success = info.get("success")
    if success is not None and not _is_bool(success):
        raise _Invalid(f"info['success'] is {type(success).__name__}, not bool")
    state_key = info.get("state_key")
    try:
        hash(state_key)
    except TypeError:
        raise _Invalid(f"info['state_key'] ({type(state_key).__name__}) is not hashable") from None
    metrics = info.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise _Invalid(f"info['metrics'] is {type(metrics).__name__}, not dict")
    bad = [k for k, v in metrics.items() if not isinstance(k, str) or not is_finite(v)]
    if bad:
        raise _Invalid(f"info['metrics'] has non-numeric or non-finite entries {bad[:5]}")
    use_tool = info.get("use_tool", False)
    if not _is_bool(use_tool):
        raise _Invalid(f"info['use_tool'] is {type(use_tool).__name__}, not bool")
    return {
        "success": None if success is None else bool(success),
        "state_key": state_key,
        "metrics": {k: float(v) for k, v in metrics.items()},
        "use_tool": bool(use_tool),
    }


def _check_reset(out: object) -> dict[str, Any]:
    if not isinstance(out, tuple) or len(out) != 2:
        raise _Invalid(f"reset returned {type(out).__name__}, not a 2-tuple (observation, info)")
    obs, info = out
    if not isinstance(obs, str):
        raise _Invalid(f"reset's observation is {type(obs).__name__}, not str")
    fields = _info_fields(info)
    instruction = info.get("instruction", "")
    if not isinstance(instruction, str):
        raise _Invalid(f"info['instruction'] is {type(instruction).__name__}, not str")
    return {
        "observation": obs,
        "instruction": instruction,
        "state_key": fields["state_key"],
        "info": info,
    }


def _check_step(out: object) -> dict[str, Any]:
    if not isinstance(out, tuple) or len(out) != 5:
        what = f"a {len(out)}-tuple" if isinstance(out, tuple) else type(out).__name__
        raise _Invalid(
            f"step returned {what}, not a 5-tuple (observation, reward, terminated, truncated, info)"
        )
    obs, reward, terminated, truncated, info = out
    if not isinstance(obs, str):
        raise _Invalid(f"observation is {type(obs).__name__}, not str")
    if not is_finite(reward):
        raise _Invalid(f"reward {reward!r} is not a finite number")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not _is_bool(flag):
            raise _Invalid(f"{name} is {type(flag).__name__}, not bool")
    return {
        "observation": obs,
        "reward": float(reward),
        "terminated": bool(terminated),
        "truncated": bool(truncated),
        **_info_fields(info),
    }


# ---------------------------------------------------------------------------------------------------------
# Framing: length-prefixed pickles over a stream socket (rank <-> episode process).

_HEADER = struct.Struct("!Q")


def _frame(obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> tuple[str, object]:
    """The next command from the rank: (kind, argument)."""
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, n))


class EpisodeConnection:
    """The rank's end of one episode process's socket: blocking sends, non-blocking reads of one reply."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        sock.setblocking(False)

    def send(self, obj: object, timeout_s: float) -> None:
        # a command is small: this only waits if the child is gone strange
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(_frame(obj))
        finally:
            self.sock.setblocking(False)

    def poll(self) -> tuple[bool, Any]:
        """Read what has arrived; (True, reply) once a whole reply is in. EOFError when the child is gone
        without one."""
        gone = False
        while not gone:
            try:
                chunk = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionError:
                chunk = b""
            gone = not chunk
            self.buf += chunk
        if len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) >= _HEADER.size + n:
                reply = pickle.loads(bytes(self.buf[_HEADER.size : _HEADER.size + n]))
                del self.buf[: _HEADER.size + n]
                return True, reply
        if gone:
            raise EOFError("the environment process closed its socket")
        return False, None

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------------------------
# The episode process (forked by the host).


def _episode_main(sock: socket.socket, spec: dict[str, Any]) -> None:
    """Serve one episode: ``reset`` builds the environment and resets it, ``step`` steps it; every reply is
    ``(status, payload)`` with status ok / error / invalid. Ends on ``close`` or when the rank goes away."""
    env = None
    try:
        while True:
            kind, arg = _recv_frame(sock)
            if kind == "close":
                break
            try:
                if kind == "reset":
                    env = make_env(spec["env"], spec["env_options"])
                    reply: tuple[str, Any] = ("ok", _check_reset(env.reset(seed=arg)))
                else:
                    if env is None:
                        raise RuntimeError("step before a successful reset")
                    reply = ("ok", _check_step(env.step(arg)))
            except _Invalid as e:
                reply = ("invalid", str(e))
            except BaseException as e:  # noqa: BLE001 - the environment's own failure, reported as such
                reply = ("error", _describe(e))
            try:
                data = _frame(reply)
            except Exception as e:  # noqa: BLE001 - e.g. an info holding a lock or a generator
                data = _frame(("invalid", f"the reply cannot be sent: {_describe(e)}"))
            sock.sendall(data)
    except (EOFError, OSError):
        pass  # the rank closed our socket (or died): close the environment and go
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            # the kernel ends us if close() hangs, GIL or not
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, spec["close_timeout_s"])
            try:
                close()
            except BaseException:  # noqa: BLE001 - nothing to report to: the episode is over
                pass


# ---------------------------------------------------------------------------------------------------------
# The host process: preloads the environment class, forks episode processes, kills and reaps them.


def _fork_episode(control: socket.socket, spec: dict[str, Any]) -> tuple[int, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the episode process
        code = 0
        try:
            control.close()
            ours.close()
            die_with_parent(host_pid)
            _episode_main(theirs, spec)
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            # what the environment printed (os._exit skips flushing)
            for stream in (
                sys.stdout,
                sys.stderr,
            ):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(code)
    theirs.close()
    return pid, ours


def _reap(live: set[int]) -> None:
    while live:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            live.clear()
            return
        if pid == 0:
            return
        live.discard(pid)


def _end_children(live: set[int], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the children to exit (they were told to close), then SIGKILL the rest."""
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        _reap(live)
        time.sleep(0.02)
    for pid in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in list(live):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        live.discard(pid)


def _host_main(control_fd: int) -> None:
    """The host's loop over its control socket (SOCK_SEQPACKET: one record per message). Records in:
    ``("fork", n)``, ``("kill", pids)``, ``("shutdown", grace_s)``; out: ``("ready", pid)`` once,
    ``("forked", pid)`` with the episode socket attached (SCM_RIGHTS) or ``("error", why)`` per fork,
    ``("bye", None)``. End-of-file on the socket (the rank is gone) kills every child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the rank's to handle
    control = socket.socket(fileno=control_fd)
    spec = pickle.load(sys.stdin.buffer)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # the rank's import path: environments named by its modules import here
    sys.path[:] = spec["sys_path"]
    try:
        env_class(spec["env"])  # import once here, so every episode process shares the code
    except BaseException as e:  # noqa: BLE001
        control.send(pickle.dumps(("error", _describe(e))))
        return
    control.send(pickle.dumps(("ready", os.getpid())))
    gc.freeze()  # keep the preloaded objects out of the children's garbage collections (fewer copied pages)
    live: set[int] = set()
    try:
        _host_loop(control, spec, live)
    finally:
        # the rank is gone (or this loop broke): no episode process outlives us
        _end_children(live, 0.0)


def _host_loop(control: socket.socket, spec: dict[str, Any], live: set[int]) -> None:
    while True:
        readable, _, _ = select.select([control], [], [], 0.5)
        _reap(live)
        if not readable:
            continue
        try:
            data = control.recv(CONTROL_RECORD)
        except OSError:
            data = b""
        if not data:  # the rank is gone
            return
        kind, arg = pickle.loads(data)
        if kind == "fork":
            for _ in range(arg):
                try:
                    pid, ours = _fork_episode(control, spec)
                except OSError as e:
                    control.send(pickle.dumps(("error", _describe(e))))
                    continue
                live.add(pid)
                socket.send_fds(control, [pickle.dumps(("forked", pid))], [ours.fileno()])
                ours.close()
        elif kind == "kill":
            for pid in arg:
                if pid in live:  # not reaped yet, so the pid is still that child's
                    os.kill(pid, signal.SIGKILL)
        elif kind == "shutdown":
            _end_children(live, arg)
            control.send(pickle.dumps(("bye", None)))
            return


class EnvHost:
    """The rank's handle on its host process: fork episode processes, kill hung ones, shut everything down.
    A host that died (the OOM killer) is started again at the next fork request; its children died with it
    and their episodes end with an error."""

    def __init__(self, env: str, env_options: dict[str, Any], close_timeout_s: float):
        self.spec = {
            "env": env,
            "env_options": env_options,
            "close_timeout_s": close_timeout_s,
            "sys_path": list(sys.path),
        }
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.start()

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        environ = {**os.environ, **SINGLE_THREADED}
        # rollhpc's own location, before anything else
        root = str(Path(__file__).resolve().parents[2])
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, environ.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "rollhpc.envs.host", str(theirs.fileno())],
                stdin=subprocess.PIPE,
                pass_fds=[theirs.fileno()],
                env=environ,
            )
        finally:
            theirs.close()
        self.control = ours
        ours.settimeout(HOST_REPLY_S)
        try:
            self.proc.stdin.write(pickle.dumps(self.spec))
            self.proc.stdin.close()
            kind, arg = pickle.loads(
                ours.recv(CONTROL_RECORD) or pickle.dumps(("error", "it exited"))
            )
        except (OSError, EOFError) as e:
            kind, arg = "error", _describe(e)
        if kind != "ready":
            self.stop(0.0)
            raise RuntimeError(f"the environment host process did not start: {arg}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def fork(self, n: int) -> list[tuple[int, socket.socket] | str]:
        """``n`` new episode processes: (pid, socket) each, or the reason one could not be made."""
        if n == 0:
            return []
        if not self.alive():
            if self.proc is not None:
                log.warning(
                    "env role: the environment host process is gone (exit code %s); starting a new one",
                    self.proc.returncode,
                )
            self.stop(0.0)
            self.start()
        out: list[tuple[int, socket.socket] | str] = []
        try:
            self.control.send(pickle.dumps(("fork", n)))
            for _ in range(n):
                data, fds, _, _ = socket.recv_fds(self.control, CONTROL_RECORD, 1)
                if not data:
                    raise EOFError("the environment host process exited")
                kind, arg = pickle.loads(data)
                if kind == "forked" and fds:
                    out.append((arg, socket.socket(fileno=fds[0])))
                # the socket did not arrive (this process is out of file descriptors)
                elif kind == "forked":
                    self.kill([arg])
                    out.append(
                        "error: cannot receive an environment process's socket (open files limit?)"
                    )
                else:
                    out.append(f"error: {arg}")
        except (OSError, EOFError) as e:
            out += [f"error: cannot start an environment process: {_describe(e)}"] * (n - len(out))
            # a host that stopped answering is replaced (its episodes end)
            if isinstance(e, TimeoutError):
                log.error("env role: the environment host process stopped answering; replacing it")
                self.stop(0.0)
        return out

    def kill(self, pids: list[int]) -> None:
        if pids and self.alive():
            try:
                self.control.send(pickle.dumps(("kill", pids)))
            except OSError:
                pass  # the host is gone, and its children with it

    def stop(self, grace_s: float) -> None:
        """End every episode process (each has been told to close; the rest are killed after ``grace_s``)
        and the host. Nothing of this rank's environments runs after it."""
        if self.proc is None:
            return
        if self.alive() and self.control is not None:
            try:
                self.control.settimeout(grace_s + 10.0)
                self.control.send(pickle.dumps(("shutdown", grace_s)))
                self.control.recv(CONTROL_RECORD)
            except OSError:
                pass
        if self.control is not None:
            self.control.close()  # end-of-file: a host that did not get the shutdown kills its children
            self.control = None
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its children follow (parent-death signal)
            self.proc.wait()
        self.proc = None


if __name__ == "__main__":  # the host process: python -P -m rollhpc.envs.host CONTROL_FD
    _host_main(int(sys.argv[1]))
