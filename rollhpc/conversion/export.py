"""A run's trained model as a Hugging Face directory: ``rollhpc export RUN_DIR [--step N] OUT_DIR``, and
the end of a run with ``pipeline.options.export_hf: final`` (``RUN_DIR/export/hf``).

What is exported is the trainer's model of one checkpoint, ``RUN_DIR/checkpoints/step_N/train/model`` (a
megatron dist checkpoint at the trainer's layout): by default the newest good checkpoint, the one a resume
would use, or step N's. ``convert.mcore_to_hf`` writes it (safetensors, config.json, and the tokenizer and
generation config of the model the run started from; a generation config derived from config.json where that
model had none), streaming one tensor at a time in a worker process of its own, so it needs no MPI world and
can run in the controller at the end of a run as well as on a login node. OUT_DIR is written beside its place
and renamed into it once complete: it exists whole or not at all.

Import-light: nothing of torch or megatron loads until a conversion starts (the CLI's ``--help`` stays fast).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollhpc.checkpoint.mcore_files import META_FILE
from rollhpc.checkpoint.role_files import MODEL_DIR
from rollhpc.checkpoint.storage import (
    MANIFEST,
    STEP_DIR_RE,
    Checkpoint,
    CheckpointStore,
    step_dir_name,
)
from rollhpc.rundir import RunPaths

if TYPE_CHECKING:
    from rollhpc.conversion.convert import Report

__all__ = [
    "ExportError",
    "ExportSource",
    "FINAL_EXPORT",
    "add_arguments",
    "export_run",
    "final_export_dir",
    "find_source",
    "run",
]

FINAL_EXPORT = Path("export") / "hf"  # where ``export_hf: final`` writes, under the run directory
TRAINER_ROLE = "train"


class ExportError(ValueError):
    """The input cannot be exported as given (not a run directory, no such checkpoint, OUT_DIR exists): the
    message is one line saying what to give instead."""


@dataclass(frozen=True)
class ExportSource:
    """The checkpoint an export reads, and why that one."""

    checkpoint: Checkpoint
    model_dir: Path  # step_N/train/model: the megatron checkpoint mcore_to_hf reads
    why: str  # "the run's newest good checkpoint" or "the checkpoint --step N asks for"

    def describe(self) -> str:
        return f"{self.why}, {self.checkpoint.path.name}"


def final_export_dir(run_dir: str | Path) -> Path:
    """Where ``export_hf: final`` puts the run's model: ``RUN_DIR/export/hf``."""
    return Path(run_dir) / FINAL_EXPORT


def find_source(
    run_dir: str | Path, step: int | None = None, role: str = TRAINER_ROLE
) -> ExportSource:
    """The ``role`` model of the run's newest good checkpoint (files match the manifest's sizes, as a resume
    checks them), or of checkpoint ``step``. ``ExportError`` names what is there when that is not possible."""
    run_dir = Path(run_dir)
    root = RunPaths(run_dir).checkpoints
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such directory (give a run directory, runs/NAME)")
    if not root.is_dir():
        step_dir = STEP_DIR_RE.fullmatch(run_dir.name)
        if step_dir and run_dir.parent.name == RunPaths.CHECKPOINTS:
            raise ExportError(
                f"{run_dir} is one checkpoint of a run: give the run directory and the step, "
                f"`rollhpc export {run_dir.parent.parent} --step {int(step_dir.group(1))} OUT_DIR`"
            )
        if (run_dir / MANIFEST).is_file() or step_dir or run_dir.name == RunPaths.CHECKPOINTS:
            raise ExportError(
                f"{run_dir} is part of a run's checkpoints: give the run directory (and --step N for "
                "one checkpoint)"
            )
        if not RunPaths(run_dir).config.is_file():
            raise ExportError(f"{run_dir} is not a run directory (no config.yaml, no checkpoints/)")
        raise ExportError(
            f"{run_dir} has no checkpoints yet (pipeline.options.checkpoint.every writes them during "
            "the run, checkpoint.at_end after its last step)"
        )
    store = CheckpointStore(root)
    if step is None:
        checkpoint = store.latest_good()
        if checkpoint is None:
            raise ExportError(
                f"{run_dir}: no good checkpoint in {root} (steps there: {_steps_there(store)}; "
                f"`rollhpc ckpt list {run_dir}` says why)"
            )
        why = "the run's newest good checkpoint"
    else:
        problems = store.verify(step, deep=False)
        if problems:
            detail = "" if not (root / step_dir_name(step)).exists() else f" ({problems[0]})"
            raise ExportError(
                f"{run_dir}: no good checkpoint of step {step}{detail}; steps there: "
                f"{_steps_there(store)}"
            )
        checkpoint = store.get(step)
        why = f"the checkpoint --step {step} asks for"
    model_dir = checkpoint.path / role / MODEL_DIR
    if not (model_dir / META_FILE).is_file():
        raise ExportError(
            f"{checkpoint.path} holds no {role} model ({role}/{MODEL_DIR}/{META_FILE} is missing): "
            f"was it written by a run with a '{role}' role?"
        )
    return ExportSource(checkpoint, model_dir, why)


def _steps_there(store: CheckpointStore) -> str:
    """The steps of every checkpoint directory, each not-good one with its status: '6, 8 (corrupt)'."""
    rows = store.statuses()
    return (
        ", ".join(f"{r.step}" + ("" if r.status == "ok" else f" ({r.status})") for r in rows)
        or "none"
    )


def check_out_dir(out_dir: str | Path, source: ExportSource, overwrite: bool) -> Path:
    """OUT_DIR as an absolute path, once it is known that writing it harms nothing: it does not exist (or
    ``overwrite``), it is not inside the run's checkpoints (a checkpoint's files must match its manifest), and
    it does not hold them (``overwrite`` would replace the run directory, or a folder above it)."""
    out = Path(out_dir).resolve()
    checkpoints = source.checkpoint.path.parent.resolve()
    if out == checkpoints or checkpoints in out.parents or out in checkpoints.parents:
        raise ExportError(
            f"{out_dir} {'holds' if out in checkpoints.parents else 'is inside'} the run's checkpoints "
            f"({checkpoints}): write the export elsewhere, e.g. {checkpoints.parent / FINAL_EXPORT}"
        )
    if out.exists() and not overwrite:
        raise ExportError(
            f"{out_dir} exists; pass --overwrite to replace it (once the new one is complete)"
        )
    return out


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    step: int | None = None,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
    max_shard_size: str | int = "2GB",
) -> tuple[ExportSource, Report]:
    """Write the trainer's model of a run's checkpoint (``find_source``) to ``out_dir`` as a Hugging Face
    directory; returns the source and ``convert.Report`` (``verify``: with the logit comparison). Raises
    ``ExportError`` for the input, ``checks.ConversionError`` when the conversion itself fails."""
    source = find_source(run_dir, step)
    out = check_out_dir(out_dir, source, overwrite)
    # torch loads with the conversion only: `rollhpc --help` imports this module
    from rollhpc.conversion.convert import mcore_to_hf

    report = mcore_to_hf(
        source.model_dir,
        out,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        verify=verify,
        progress=progress,
    )
    return source, report


def describe_output(out_dir: Path) -> str:
    """What an HF directory holds, for one line: its safetensors files and the other files by name."""
    files = sorted(p for p in Path(out_dir).iterdir() if p.is_file())
    weights = [p for p in files if p.suffix == ".safetensors"]
    size = sum(p.stat().st_size for p in weights) / 2**20
    others = [p.name for p in files if p.suffix != ".safetensors"]
    return f"{len(weights)} safetensors file(s), {size:.1f} MiB, and {', '.join(others)}"


# ------------------------------------------------------------------ command line

EPILOG = (
    "Example: rollhpc export runs/quickstart models/quickstart-final; rollhpc export runs/quickstart --step 200 "
    "models/quickstart-200 --verify. A run with pipeline.options.export_hf=final writes RUN_DIR/export/hf by "
    "itself when it finishes. `rollhpc ckpt list RUN_DIR` shows the checkpoints there are. Exit status: 0; 1 "
    "when the conversion or --verify fails; 2 for a RUN_DIR, step or OUT_DIR that cannot be used."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="the run's directory, runs/NAME"
    )
    parser.add_argument(
        "out_dir", type=Path, metavar="OUT_DIR", help="Hugging Face model directory to create"
    )
    parser.add_argument(
        "--step",
        type=_step,
        metavar="N",
        help="export the checkpoint of step N (default: the newest "
        "good checkpoint, the one a resume would use)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR if it exists (once the new one is complete)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="afterwards, compare the logits of the exported model "
        "(transformers) and the checkpoint (megatron) on a few prompts; exit 1 if they differ",
    )
    parser.add_argument(
        "--max-shard-size",
        default="2GB",
        metavar="SIZE",
        help="largest safetensors file, e.g. 500MB, 5GB (default 2GB)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"expected a step number >= 0, got {text!r}")
    return step


def run(args: argparse.Namespace) -> int:
    """0: exported (and verified); 1: the conversion or its verification failed; 2: input that cannot be used."""
    try:
        source = find_source(args.run_dir, args.step)
        out = check_out_dir(args.out_dir, source, args.overwrite)
        from rollhpc.conversion.checks import ConversionError
        from rollhpc.conversion.convert import mcore_to_hf, parse_size

        parse_size(args.max_shard_size)
    except (ExportError, ValueError) as e:  # parse_size's ValueError: a bad --max-shard-size
        print(f"rollhpc export: {e}", file=sys.stderr)
        return 2
    print(
        f"rollhpc export: reading {source.model_dir.absolute()} ({source.describe()})",
        file=sys.stderr,
    )
    try:
        report = mcore_to_hf(
            source.model_dir,
            out,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            verify=args.verify,
            progress=not args.no_progress,
        )
    except (ConversionError, ValueError) as e:
        print(f"rollhpc export: error: {e}", file=sys.stderr)
        return 1
    print(
        f"rollhpc export: wrote {out}: {describe_output(out)} "
        f"({report.seconds:.1f} s{report.verify_summary()})",
        file=sys.stderr,
    )
    return 0 if report.verify is None or report.verify["ok"] else 1
