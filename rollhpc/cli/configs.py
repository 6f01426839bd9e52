"""``rollhpc configs``: the experiments found by name."""

from __future__ import annotations

import argparse
import sys

from rollhpc import experiments


def cmd_configs(args: argparse.Namespace) -> int:
    found = experiments.available()
    width = max((len(e.name) for e in found), default=0)
    for e in found:
        print(f"{e.name:<{width}}  {e.description}" + (f"  [{e.path}]" if args.paths else ""))
    print(
        "searched, first match wins: " + ", ".join(str(d) for d in experiments.search_path()),
        file=sys.stderr,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:

    cf = sub.add_parser(
        "configs",
        help="list the experiments found by name, one line each",
        description="List every experiment NAME that `rollhpc train NAME` finds, with the first "
        "sentence of its leading comment. Searched in order, first match wins: ./configs/, each "
        "folder of ROLLHPC_CONFIG_PATH (':'-separated), then the configs rollhpc ships (configs/ "
        "of a source checkout, or the copy `pip install` puts under PREFIX/share/rollhpc/configs).",
    )
    cf.add_argument("--paths", action="store_true", help="also print each experiment's file")
    cf.set_defaults(func=cmd_configs)
