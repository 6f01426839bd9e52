"""``rollhpc plan``: where every rank runs and what each GPU holds, without starting anything."""

from __future__ import annotations

import argparse

from rollhpc.cli.experiment import check_inputs, experiment_args, reads_experiment
from rollhpc.config import ExperimentConfig
from rollhpc.launch.plan_report import render
from rollhpc.placement.device_mapping import plan_world
from rollhpc.placement.memory_plan import estimate


@reads_experiment
def cmd_plan(cfg: ExperimentConfig, args: argparse.Namespace) -> int:
    plan = plan_world(cfg)
    check_inputs(cfg, refuse=False)
    memory = estimate(cfg, plan) if plan.gpus_total else None
    if args.json:
        print(plan.to_json())
    else:
        for line in render(
            cfg, plan, ranks=not args.no_ranks, groups=args.groups, max_groups=args.max_groups
        ):
            print(line)
        for line in memory.render() if memory else ():
            print(line)
    if memory:
        memory.check()  # after the report, which shows where the memory goes
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:

    pl = sub.add_parser(
        "plan",
        help="print where every rank of every role runs (node, GPUs, het group) and its "
        "parallel groups",
        description="Validate an experiment's device mapping against its cluster "
        "description (cluster.nodes, cluster.gpus_per_node, ...) and print the plan, without "
        "starting or submitting anything. Impossible mappings fail with one message. For GPU roles "
        "it also estimates each GPU's memory stage by stage (generate, reference, train, weight "
        "sync...), with colocated roles all resident (offload off) and taking turns (offload on), "
        "from the models' config.json; with cluster.gpu_memory_gb set, a mapping whose peak "
        "exceeds it even with offload is refused here and by submit.",
    )
    experiment_args(pl)
    pl.add_argument(
        "--groups",
        action="store_true",
        help="also print each role's parallel groups (tp, cp, dp, pp, ...)",
    )
    pl.add_argument(
        "--max-groups", type=int, default=4, help="groups shown per kind (0 = all; default 4)"
    )
    pl.add_argument("--no-ranks", action="store_true", help="omit the per-rank table")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)
