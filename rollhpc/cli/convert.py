"""``rollhpc convert`` and ``rollhpc export``: checkpoints between Hugging Face and Megatron formats, and a run's
trained model as a Hugging Face directory."""

from __future__ import annotations

import argparse

from rollhpc.conversion import convert_cli, export


def cmd_convert(args: argparse.Namespace) -> int:
    return convert_cli.run(args)


def cmd_export(args: argparse.Namespace) -> int:
    return export.run(args)


def add_convert_parser(sub: argparse._SubParsersAction) -> None:

    cv = sub.add_parser(
        "convert",
        help="convert checkpoints between Hugging Face and Megatron formats",
        description="Convert a Hugging Face safetensors model to a megatron-core dist checkpoint "
        "(hf-to-mcore, at any TP/PP/EP layout) or back (mcore-to-hf). Runs here, in local worker "
        "processes; slurm/convert.sh runs it as a batch job.",
    )
    convert_cli.add_arguments(cv)
    cv.set_defaults(func=cmd_convert)


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser(
        "export",
        help="a run's trained model as a Hugging Face directory (safetensors, config, "
        "tokenizer, generation config)",
        description="Write OUT_DIR, a Hugging Face model directory that transformers and vLLM load, "
        "from the trainer's model of a run's checkpoint (RUN_DIR/checkpoints/step_N/train/model): "
        "by default the newest good checkpoint, the one a resume would use; with --step N that "
        "step's. Dense and MoE models; safetensors, config.json, and the tokenizer and generation "
        "config of the model the run started from (one derived from config.json where it had "
        "none). Runs here, in a local worker process, one tensor at a time; OUT_DIR appears complete "
        "or not at all.",
        epilog=export.EPILOG,
    )
    export.add_arguments(ex)
    ex.set_defaults(func=cmd_export)
