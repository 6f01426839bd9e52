"""``rollhpc env``: play episodes of a text environment."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from rollhpc.config import ConfigError
from rollhpc.envs.episodes import run_episodes
from rollhpc.sandbox import SandboxUnavailable


def _env_options(pairs: list[str]) -> dict[str, Any]:
    """--option KEY=VALUE (YAML values) -> the environment's constructor keywords."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--option expects KEY=VALUE, got {pair!r}")
        options[key] = yaml.safe_load(text)
    return options


def cmd_env(args: argparse.Namespace) -> int:
    options = _env_options(args.option or [])
    try:
        stats = run_episodes(
            args.name, options, args.policy, args.episodes, args.seed, args.max_new_tokens
        )
    except (ValueError, SandboxUnavailable) as e:
        print(f"rollhpc env: {e}", file=sys.stderr)
        return 2
    print(stats.summary())
    if args.show:
        print(stats.played[0].render())
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:

    ev = sub.add_parser(
        "env",
        help="play episodes of a text environment with a random, expert or model policy",
        description="Play --episodes episodes of the text environment NAME (seeds --seed, --seed+1, "
        "...) and print its success rate, mean turns and mean return (and the mean per episode of "
        "each metric the environment reports, e.g. invalid_action). The policy is `random` "
        "(uniform over the environment's example actions), `expert` (its expert_action: BFS or "
        "optimal play) or a Hugging Face model directory (greedy, in the plain-text turn format "
        "of rollhpc.rollout.turns, the row capped at the model's context). Random and expert bound "
        "what training on the environment can show.",
        epilog="NAME is a shipped environment (frozenlake, sokoban, python_tool; a wrong name lists "
        "them all) or package.module:Class. Options are the environment's constructor keywords as "
        "KEY=VALUE (YAML values), e.g. "
        "`rollhpc env frozenlake --option size=6 --option is_slippery=true --policy expert`, "
        "`rollhpc env python_tool --option task=countdown --show`. Exit status: 0, or 2 for an "
        "unknown environment, bad options or policy, or no sandbox for a code-running environment.",
    )
    ev.add_argument(
        "name", metavar="NAME", help="environment: a short name or package.module:Class"
    )
    ev.add_argument(
        "--episodes", type=int, default=20, metavar="N", help="episodes to play (default 20)"
    )
    ev.add_argument(
        "--policy",
        default="random",
        metavar="POLICY",
        help="random, expert or a model directory (default random)",
    )
    ev.add_argument(
        "--option", action="append", metavar="KEY=VALUE", help="an environment option (repeatable)"
    )
    ev.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    ev.add_argument("--show", action="store_true", help="also print the first episode's transcript")
    ev.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        metavar="N",
        help="a model policy's most tokens per turn (default 32)",
    )
    ev.set_defaults(func=cmd_env)
