"""``rollhpc``: the command line. Each command is a module of this package that owns its arguments
(``add_parser``) and runs them (``cmd_*``); ``experiment`` is what the commands that read an experiment share,
and the only module that imports hydra.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from rollhpc.cli import (
    ckpt,
    configs,
    convert,
    env,
    plan,
    report,
    sandbox,
    sft,
    status,
    submit,
    train,
)
from rollhpc.cli.experiment import compose, load_experiment
from rollhpc.config import ConfigError

__all__ = ["build_parser", "compose", "load_experiment", "main"]


def _version() -> str:
    try:
        return version("rollhpc")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
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
    # the order `rollhpc --help` lists them in
    for add in (
        configs.add_parser,
        train.add_parser,
        plan.add_parser,
        submit.add_parser,
        status.add_parser,
        report.add_parser,
        sft.add_parser,
        convert.add_convert_parser,
        convert.add_export_parser,
        ckpt.add_parser,
        sandbox.add_parser,
        env.add_parser,
    ):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"rollhpc: config error: {e}", file=sys.stderr)
        return 2
