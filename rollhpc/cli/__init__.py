"""``rollhpc``: the command line. Each command is a module of this package that owns its arguments
(``add_parser``) and runs them (``cmd_*``); ``experiment`` is what the commands that read an experiment share,
and the only module that imports hydra.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

__all__ = ["build_parser", "main"]

# (command, its module in this package, the function that adds its parser), in the order `rollhpc --help`
# lists them. A command line that names one loads only that command's module: each imports what it runs
# (hydra, the config, the launchers, ...), which the others need not pay for.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("configs", "configs", "add_parser"),
    ("train", "train", "add_parser"),
    ("plan", "plan", "add_parser"),
    ("submit", "submit", "add_parser"),
    ("status", "status", "add_parser"),
    ("report", "report", "add_parser"),
    ("sft", "sft", "add_parser"),
    ("convert", "convert", "add_convert_parser"),
    ("export", "convert", "add_export_parser"),
    ("ckpt", "ckpt", "add_parser"),
    ("sandbox", "sandbox", "add_parser"),
    ("env", "env", "add_parser"),
)


def _version() -> str:
    try:
        return version("rollhpc")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "(not installed)"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line, or, when ``argv`` names a command, the parser with that command alone (its
    usage, arguments and errors are the same either way)."""
    p = argparse.ArgumentParser(
        prog="rollhpc",
        description="RL post-training of language models on Slurm/HPC: a single controller drives worker "
        "groups (train, generate, reference, critic, reward, env) over MPI.",
        epilog="Experiments are NAME (NAME.yaml in ./configs, ROLLHPC_CONFIG_PATH or the shipped configs: "
        "`rollhpc configs` lists them) or a path to a YAML file; append key=value overrides "
        "(hydra syntax), e.g. `rollhpc train quickstart pipeline.options.steps=10`.",
    )
    p.add_argument("--version", action="version", version=f"rollhpc {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p.subcommands = sub.choices  # type: ignore[attr-defined]  # name -> its parser, for main's errors
    named = _named_command(argv) if argv is not None else None
    for name, module, add in COMMANDS:
        if named in (None, name):
            getattr(importlib.import_module(f"{__name__}.{module}"), add)(sub)
    return p


def _named_command(argv: list[str]) -> str | None:
    """The command an argument list names (its first word that is not an option), if it is one of ours."""
    words = [a for a in argv if not a.startswith("-")]
    names = {name for name, _, _ in COMMANDS}
    return words[0] if words and words[0] in names else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # overrides may come after flags (`train quickstart --overwrite a.b=1`): collect them too
    stray = [
        x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")
    ]
    if stray and args.command != "convert":  # the subcommand's usage, which lists its flags
        parser.subcommands.get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(stray)}"
        )
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *extra]
    # loaded with the command that reads a config (rollhpc.config imports numpy): `rollhpc --help` stays light
    from rollhpc.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"rollhpc: config error: {e}", file=sys.stderr)
        return 2
