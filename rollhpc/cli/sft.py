"""``rollhpc sft``: the RL starting policy, a tiny model fine-tuned on a task."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from rollhpc.config import ConfigError
from rollhpc.tasks import available_tasks, task_module
from rollhpc.warm_start.sft_config import SftConfig
from rollhpc.warm_start.tiny_config import TinyModelConfig


def _sft_settings(pairs: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """KEY=VALUE (YAML values) -> (task options, spec.KEY fields, sft.KEY fields)."""
    task: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {"spec": {}, "sft": {}}
    allowed = {
        "spec": {f.name for f in fields(TinyModelConfig)},
        "sft": {f.name for f in fields(SftConfig)},
    }
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE, got {pair!r}")
        value = yaml.safe_load(text)
        group, dot, name = key.partition(".")
        if not dot:
            task[key] = value
        elif group in nested and name in allowed[group]:
            nested[group][name] = value
        else:
            hint = (
                f"{group}.* fields: {', '.join(sorted(allowed[group]))}"
                if group in allowed
                else "use KEY (task option), spec.KEY or sft.KEY"
            )
            raise ConfigError(f"unknown setting {key!r}; {hint}")
    return task, nested["spec"], nested["sft"]


def _accuracy_or_none(text: str) -> float | str:
    try:
        return text if text == "none" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in (0, 1] or 'none', got {text!r}"
        ) from None


def cmd_sft(args: argparse.Namespace) -> int:
    # the implementation trains a model (torch, transformers): imported once the command runs, not for --help
    from rollhpc.warm_start import policy_prep

    logging.basicConfig(level=logging.INFO, format="rollhpc: %(message)s")
    try:
        task_module(args.task)
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None
    task_opts, spec_kw, sft_kw = _sft_settings(args.overrides)
    flags = {"steps": args.steps, "lr": args.lr, "batch_size": args.batch_size}
    sft_kw |= {k: v for k, v in flags.items() if v is not None}
    if args.threads:
        import torch  # heavy, and loaded by policy_prep's trainer anyway

        torch.set_num_threads(args.threads)
    try:
        if args.target_accuracy is not None:
            sft_kw["target_accuracy"] = (
                None if args.target_accuracy == "none" else args.target_accuracy
            )
        spec, sft = TinyModelConfig(**spec_kw), SftConfig(**sft_kw)
        out = policy_prep.prepare_policy(
            args.out_dir,
            task=args.task,
            task_options=task_opts,
            spec=spec,
            sft=sft,
            seed=args.seed,
            vocab_size=args.vocab_size,
            progress=not args.quiet,
        )
    except (ValueError, TypeError, FileExistsError) as e:
        raise ConfigError(str(e)) from e
    report = policy_prep.read_report(out)
    print(
        f"rollhpc: policy {out}: held-out greedy accuracy {report['heldout_accuracy']:.3f} after "
        f"{report['steps']} SFT steps ({report['wall_s']:.0f} s to prepare)",
        file=sys.stderr,
    )
    print(out)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    sft = SftConfig()
    sf = sub.add_parser(
        "sft",
        help="prepare the RL starting policy: a tiny Qwen2 model fine-tuned on a task",
        description="Train a tokenizer on the task's train split, create a tiny Qwen2 model and "
        "fine-tune it until its greedy accuracy on training examples reaches sft.target_accuracy "
        "(or for --steps), then write OUT_DIR as a Hugging Face model directory with "
        "sft_report.json (steps, losses, held-out greedy accuracy, time, settings). OUT_DIR "
        "appears complete or not at all; if it exists with the same settings it is reused, with "
        "other settings it is an error.",
        epilog="Settings are KEY=VALUE (YAML values): a plain KEY is a task option (arithmetic: "
        "digits, ops, allow_negative; countdown: num_numbers, max_number, max_target), spec.KEY a "
        "model size (rollhpc.warm_start.tiny.TinyModelConfig), sft.KEY an SFT option "
        "(rollhpc.warm_start.sft.SftConfig). Example: `rollhpc sft policies/add3 digits=3 "
        "'ops=[+, -]' spec.num_hidden_layers=3 --steps 2000`.",
    )
    sf.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to write (or reuse)")
    sf.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="task options, spec.KEY, sft.KEY"
    )
    sf.add_argument(
        "--task",
        default="arithmetic",
        metavar="NAME",
        help=f"a task of rollhpc.tasks ({', '.join(available_tasks())}) or a task module's import path "
        "(package.module); default: arithmetic",
    )
    sf.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the splits, the initial weights and the batch order",
    )
    sf.add_argument(
        "--steps",
        type=int,
        help=f"most SFT steps (default {sft.steps}; the target accuracy stops sooner)",
    )
    sf.add_argument("--lr", type=float, help=f"peak learning rate (default {sft.lr:g})")
    sf.add_argument("--batch-size", type=int, help=f"examples per step (default {sft.batch_size})")
    sf.add_argument(
        "--target-accuracy",
        metavar="X",
        type=_accuracy_or_none,
        help="stop at this greedy accuracy on "
        f"training examples (default {sft.target_accuracy}; 'none' trains all --steps)",
    )
    sf.add_argument(
        "--vocab-size", type=int, default=512, help="tokenizer size ceiling (default 512)"
    )
    sf.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sf.add_argument("--quiet", action="store_true", help="no progress bar")
    sf.set_defaults(func=cmd_sft)
