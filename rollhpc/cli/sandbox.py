"""``rollhpc sandbox``: run untrusted Python in a bubblewrap sandbox; check the isolation."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from rollhpc.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, selfcheck


def cmd_sandbox(args: argparse.Namespace) -> int:
    try:
        if args.sandbox_command == "check":
            sandbox = Sandbox(selfcheck.CHECK_LIMITS)
            print(sandbox.describe())
            results = selfcheck.run_checks(sandbox)
            print("\n".join(selfcheck.render(results, verbose=args.verbose)))
            return 0 if all(r.ok for r in results) else 1
        changes = {
            k: v
            for k, v in (("wall_s", args.timeout), ("memory_mb", args.memory_mb))
            if v is not None
        }
        stdin = (
            ""
            if args.stdin is None
            else sys.stdin.read()
            if str(args.stdin) == "-"
            else args.stdin.read_text()
        )
        result = Sandbox(replace(SandboxLimits(), **changes)).run(args.file.read_text(), stdin)
    except SandboxUnavailable as e:
        print(f"NOT isolated  sandbox unavailable: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"rollhpc sandbox {args.sandbox_command}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(result.render()))
    return 0 if result.ok else 1


def add_parser(sub: argparse._SubParsersAction) -> None:

    sx = sub.add_parser(
        "sandbox",
        help="run untrusted Python in a bubblewrap sandbox; check the isolation here",
        description="The code sandbox reward functions and environments use (rollhpc.sandbox): "
        "each program runs under bubblewrap in its own user, pid, network, mount, IPC and UTS "
        "namespaces as uid 65534, with read-only system directories and interpreter, a private "
        "tmpfs /tmp as the only writable place, no network but lo, no /etc, home or project "
        "files, and limits on wall time, CPU time, memory, processes, open files, file size and "
        "output. Without bwrap or user namespaces nothing runs: the error says what to install "
        "or enable.",
    )
    sxs = sx.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    c = sxs.add_parser(
        "run",
        help="run FILE (Python) in a sandbox and print the result; exit 0 if its status is ok",
        description="Run a Python program in a fresh sandbox with the default limits "
        "(rollhpc.sandbox.SandboxLimits). Prints the status (ok, timeout, memory, output_limit, "
        "killed, error) and why, exit code, wall and CPU time, then stdout and stderr (each cut at "
        "64,000 bytes). Exit status: 0 if the program's status is ok, 1 otherwise, 2 if FILE "
        "cannot be read.",
    )
    c.add_argument("file", type=Path, metavar="FILE", help="the Python program")
    c.add_argument(
        "--stdin",
        type=Path,
        metavar="FILE",
        help="file given to the program as stdin ('-': this stdin)",
    )
    c.add_argument(
        "--timeout", type=float, metavar="S", help="wall-clock limit in seconds (default 10)"
    )
    c.add_argument(
        "--memory-mb", type=int, metavar="M", help="address-space limit per process (default 512)"
    )
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c = sxs.add_parser(
        "check",
        help="prove the isolation and limits on this machine: one line per check",
        description="Run real programs in real sandboxes and check what they can do: non-root "
        "uid; only lo, failing DNS, no connection to a listener on the host's 127.0.0.1; "
        "/etc/shadow, the home directory and the project unreadable; no writes outside the "
        "private /tmp; own pid namespace; process, memory, CPU-time and file-size limits hold; "
        "nothing left running after the deadline. Prints `isolated` or `NOT isolated` per check. "
        "Run it on each kind of compute node: `srun rollhpc sandbox check`.",
        epilog="Exit status: 0 if every check passed, 1 if any failed or no sandbox can be made.",
    )
    c.add_argument(
        "--verbose", action="store_true", help="show what each check saw, not only failures"
    )
    sx.set_defaults(func=cmd_sandbox)
