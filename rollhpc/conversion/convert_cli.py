"""Arguments and entry of ``rollhpc convert`` (also tools/convert_checkpoint.py). Imports no torch until a
conversion runs: ``rollhpc --help`` imports it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rollhpc.checkpoint.mcore_files import META_FILE
from rollhpc.checkpoint.storage import CheckpointStore
from rollhpc.rundir import RunPaths

if TYPE_CHECKING:
    from rollhpc.conversion.convert import Report

EPILOG = (
    "Examples: rollhpc convert hf-to-mcore models/qwen ckpt/qwen-mcore --tp 2 --ep 2 --verify; "
    "rollhpc convert mcore-to-hf ckpt/qwen-mcore models/qwen-out. A megatron checkpoint saved at one "
    "layout loads at any other (megatron reshards on load); --tp/--pp/--ep choose how it is written."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The two directions as sub-commands of ``parser``."""
    directions = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    h2m = _add_direction(
        directions,
        "hf-to-mcore",
        help="Hugging Face safetensors directory -> megatron-core dist checkpoint",
        description="Write a megatron-core dist checkpoint from a Hugging Face model directory, as a world of "
        "pp x lcm(tp, etp x ep) local processes (one per rank of that layout), each holding only its shard.",
        src="Hugging Face model directory (config.json + *.safetensors)",
        dst="checkpoint directory to create",
    )
    _add_layout_arguments(h2m)
    m2h = _add_direction(
        directions,
        "mcore-to-hf",
        help="megatron-core dist checkpoint (any layout) -> Hugging Face safetensors directory",
        description="Write a Hugging Face model directory (config.json, safetensors, tokenizer files) from a "
        "checkpoint written by `rollhpc convert hf-to-mcore` or by a training run, streaming one tensor at a time.",
        src="megatron checkpoint directory (with rollhpc_checkpoint.json), or a run "
        "directory, its checkpoints/ or a step_N/ directory: the trainer's model of that step, or of "
        "the newest good checkpoint",
        dst="Hugging Face model directory to create",
    )
    _add_hf_output_arguments(m2h)
    for sp in (h2m, m2h):
        _add_common_arguments(sp)


def _add_direction(
    directions: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    description: str,
    src: str,
    dst: str,
) -> argparse.ArgumentParser:
    """The sub-command of one direction, with its SRC and DST."""
    sp = directions.add_parser(name, help=help, description=description, epilog=EPILOG)
    sp.add_argument("src", help=src)
    sp.add_argument("dst", help=dst)
    return sp


def _add_layout_arguments(h2m: argparse.ArgumentParser) -> None:
    """The layout hf-to-mcore writes the checkpoint at."""
    for name, text in (
        ("tp", "tensor-parallel size"),
        ("pp", "pipeline-parallel size"),
        ("ep", "expert-parallel size (MoE models)"),
    ):
        h2m.add_argument(
            f"--{name}",
            type=int,
            default=1,
            help=f"{text} the checkpoint is written with (default 1)",
        )
    h2m.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert tensor-parallel size (default: tp, as megatron)",
    )


def _add_hf_output_arguments(m2h: argparse.ArgumentParser) -> None:
    """How mcore-to-hf writes and checks."""
    m2h.add_argument(
        "--max-shard-size",
        default="2GB",
        help="largest safetensors file, e.g. 500MB, 5GB (default 2GB)",
    )
    m2h.add_argument(
        "--no-checksums",
        action="store_true",
        help="skip the sha256 check of the checkpoint files (sizes are still checked)",
    )


# the on/off switches of both directions
_COMMON_FLAGS = (
    ("--overwrite", "replace DST if it exists (once the new one is complete)"),
    (
        "--verify",
        "afterwards, compare the logits of the HF and the megatron model on a few prompts",
    ),
    ("--json", "print the conversion report as JSON on stdout"),
    ("--no-progress", "no progress bar / progress lines"),
    ("--check", "only check the inputs (config, tensor names and shapes, layout, files) and exit"),
)


def _add_common_arguments(sp: argparse.ArgumentParser) -> None:
    for flag, text in _COMMON_FLAGS:
        sp.add_argument(flag, action="store_true", help=text)
    sp.set_defaults(overrides=[])  # rollhpc.cli appends stray words here; run() refuses them


def find_trainer_checkpoint(src: str | Path, role: str = "train") -> tuple[Path, str]:
    """``src`` as the megatron checkpoint to read, and what it was taken for. A run directory, its
    checkpoints/ folder or one step_N/ directory all hold the trainer's model at ``step_N/ROLE/model``:
    the step's, or the newest good checkpoint's (the one a resume would use)."""
    src = Path(src)
    if (src / META_FILE).is_file() or not src.is_dir():
        return src, ""
    if (src / role / "model" / META_FILE).is_file():
        return src / role / "model", f"the {role} role's model of checkpoint {src.name}"
    for root, what in ((RunPaths(src).checkpoints, "the run's"), (src, "the folder's")):
        if root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir()):
            newest = CheckpointStore(root).latest_good()
            if newest is None:
                raise ValueError(
                    f"{src}: no good checkpoint in {root} (`rollhpc ckpt list {src}` says why)"
                )
            return (
                newest.path / role / "model",
                f"{what} newest good checkpoint, {newest.path.name}",
            )
    return src, ""


def run(args: argparse.Namespace) -> int:
    """0: converted (and verified); 1: the conversion or its verification failed; 2: bad arguments."""
    if getattr(args, "overrides", None):
        print(
            f"rollhpc convert: unrecognized arguments: {' '.join(args.overrides)}", file=sys.stderr
        )
        return 2
    # torch loads with the conversion only: `rollhpc --help` imports this module
    from rollhpc.conversion.checks import ConversionError

    try:
        if args.direction == "mcore-to-hf":
            args.src, what = find_trainer_checkpoint(args.src)
            if what:
                print(f"rollhpc convert: reading {args.src} ({what})", file=sys.stderr)
        report = _check_or_convert(args)
    except (ConversionError, ValueError) as e:
        print(f"rollhpc convert: error: {e}", file=sys.stderr)
        return 1
    if report is None:  # --check
        return 0
    print(f"rollhpc convert: {report.summary()}", file=sys.stderr)
    print(f"rollhpc convert: wrote {report.dst}", file=sys.stderr)
    if args.json:
        print(report.json())
    if report.verify is not None and not report.verify["ok"]:
        print(
            f"rollhpc convert: verify FAILED: logits differ by {report.verify['max_abs_diff']:.3g} "
            f"(> {report.verify['atol']:g})",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_or_convert(args: argparse.Namespace) -> Report | None:
    """The conversion's report; None with ``--check``, after saying that the inputs can be converted."""
    from rollhpc.conversion.convert import (
        check_hf_to_mcore,
        check_mcore_to_hf,
        hf_to_mcore,
        mcore_to_hf,
    )

    common = dict(overwrite=args.overwrite, verify=args.verify, progress=not args.no_progress)
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp) if "tp" in args else {}
    if args.check:
        if args.direction == "hf-to-mcore":
            world = check_hf_to_mcore(args.src, args.dst, overwrite=args.overwrite, **layout)
            workers = f" ({world} worker process(es))"
        else:
            check_mcore_to_hf(args.src, args.dst, overwrite=args.overwrite)
            workers = ""
        print(f"rollhpc convert: {args.src} can be converted{workers}", file=sys.stderr)
        return None
    if args.direction == "hf-to-mcore":
        return hf_to_mcore(args.src, args.dst, **layout, **common)
    return mcore_to_hf(
        args.src,
        args.dst,
        max_shard_size=args.max_shard_size,
        checksums=not args.no_checksums,
        **common,
    )
