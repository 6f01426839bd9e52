"""``rollhpc ckpt``: list, inspect and verify a run's checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollhpc.checkpoint import report
from rollhpc.checkpoint.storage import CheckpointStorageError


def cmd_ckpt(args: argparse.Namespace) -> int:
    good = True
    try:
        if args.ckpt_command == "list":
            lines = report.list_lines(report.open_path(args.path)[0], args.deep)
        elif args.ckpt_command == "inspect":
            lines = report.inspect_lines(args.path, args.max_files)
        else:
            good, lines = report.verify_lines(args.path, args.deep)
    except CheckpointStorageError as e:
        print(f"rollhpc ckpt {args.ckpt_command}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if good else 1


def add_parser(sub: argparse._SubParsersAction) -> None:

    ck = sub.add_parser(
        "ckpt",
        help="list, inspect and verify a run's checkpoints",
        description="Read-only views of RUN_DIR/checkpoints/ (step_N/ directories with a "
        "manifest.json of every file's size and sha256, and a `latest` pointer). Safe to run "
        "while the run writes. PATH may be a run directory, its checkpoints/ folder or one "
        "checkpoint directory.",
    )
    cks = ck.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    c = cks.add_parser(
        "list",
        help="one row per checkpoint: step, time, size, status, which is latest",
        description="Status: ok (files match the manifest), corrupt (a file is missing, resized, "
        "added, or with --deep has another sha256), partial (never committed: being written, or "
        "left by a crash; ignored on resume). The last line says which checkpoint a resume uses.",
    )
    c.add_argument("path", type=Path, metavar="PATH", help="run directory or checkpoints/ folder")
    c.add_argument(
        "--deep", action="store_true", help="also compare every file's sha256 (reads everything)"
    )
    c = cks.add_parser(
        "inspect",
        help="one checkpoint: manifest summary, meta, optimizer state, files by size, "
        "tensor shapes",
        description="Print a checkpoint's step, time, size and status, its meta (JSON given at "
        "commit), per trainer role (train, critic) its optimizer: the stack that saved it (megatron's "
        "distributed optimizer, megatron's optimizer without it, or older runs' torch AdamW), the "
        "ranks that saved it and their TP/PP/DP, the optimizer step, the format and whether it loads "
        "at another layout, and per kind of state (main params, exp_avg, exp_avg_sq) its tensors, "
        "elements, dtype and bytes, the shard files and their bytes on disk; then its files largest "
        "first, and the tensor names, dtypes and shapes of its .safetensors (header only) and .pt "
        "files. A run directory shows the checkpoint `latest` names. Reads files only, builds no "
        "model.",
    )
    c.add_argument(
        "path", type=Path, metavar="PATH", help="checkpoint directory (or run directory: latest)"
    )
    c.add_argument(
        "--max-files", type=int, default=20, metavar="N", help="files listed (0 = all; default 20)"
    )
    c = cks.add_parser(
        "verify",
        help="check files against manifests; exit 0 if good, 1 with one line per problem",
        description="Compare every file with its checkpoint's manifest (set of files, sizes; "
        "sha256 with --deep). A run directory or checkpoints/ folder checks every committed "
        "checkpoint and the `latest` pointer. Exit 0: good; 1: problems, one per line; 2: no "
        "such path.",
    )
    c.add_argument(
        "path",
        type=Path,
        metavar="PATH",
        help="checkpoint directory, run directory or checkpoints/",
    )
    c.add_argument(
        "--deep", action="store_true", help="also compare every file's sha256 (reads everything)"
    )
    ck.set_defaults(func=cmd_ckpt)
