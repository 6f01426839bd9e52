"""``rollhpc``: the command line. The only module that imports hydra.

Hydra composes configs/EXP.yaml (or a YAML path) with ``key=value`` overrides; the result is
handed to rollhpc.config as a plain dict and validated there, so the library never sees hydra.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from rollhpc import config as config_mod
from rollhpc import experiments
from rollhpc.checkpoint import convert_cli
from rollhpc.config import ConfigError, ExperimentConfig
from rollhpc.rundir import RunPaths, atomic_write_text

def compose(experiment: str, overrides: list[str]) -> dict[str, Any]:
    """Experiment name (configs/NAME.yaml) or path to a YAML file, plus hydra overrides -> dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(experiment)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"no such config file: {path}")
        config_dir, name = path.resolve().parent, path.stem
    else:
        found = experiments.find(experiment)
        if found is None:
            known = [e.name for e in experiments.available()]
            raise ConfigError(f"unknown experiment {experiment!r}; known: {', '.join(known)} (or a path to a .yaml; "
                              f"`rollhpc configs` lists them with where they are)")
        path, config_dir, name = found, found.parent, experiment
    check_yaml_syntax(path)
    check_override_syntax(overrides)
    # `key=value` may set a key the YAML leaves to its dataclass default (roles.train.parallel.tp=2):
    # hydra would refuse it as new, so every plain override becomes "add or override" (++) and
    # rollhpc.config then rejects keys that exist nowhere, naming the valid ones.
    overrides = [o if o.startswith(("+", "~")) else f"++{o}" for o in overrides]
    # ${range:a,b} -> [a, ..., b-1]: device lists of thousands of GPUs without writing them out
    OmegaConf.register_new_resolver("range", lambda a, b: list(range(int(a), int(b))), replace=True)
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = hydra_compose(config_name=name, overrides=overrides)
        return OmegaConf.to_container(composed, resolve=True)  # type: ignore[return-value]
    except yaml.YAMLError as e:  # a file the experiment's defaults list pulls in
        raise ConfigError(yaml_error_line(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot apply overrides {overrides}: {' '.join(str(e).split())}") from e


def yaml_error_line(e: yaml.YAMLError, path: Path | None = None) -> str:
    """A YAML syntax error as one line: FILE:LINE:COLUMN: what is wrong (and what to do about a tab)."""
    mark = getattr(e, "problem_mark", None)
    where = str(path or (mark.name if mark else "config"))
    if mark is not None:
        where += f":{mark.line + 1}:{mark.column + 1}"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if "'\\t'" in problem or "\t" in problem:
        problem += " (YAML indents with spaces, never tabs)"
    return f"{where}: YAML syntax: {problem}"


def check_yaml_syntax(path: Path) -> None:
    """Parse the experiment's file before hydra does: hydra's own error is an 80-line traceback."""
    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_line(e, path)) from None


def check_override_syntax(overrides: list[str]) -> None:
    """Each ``key=value`` through hydra's own override parser, so a bad one is named alone, in one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override if override.startswith(("+", "~")) else f"++{override}")
        except HydraException as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"override {override!r}: {first} (hydra syntax: key=value; quote a value with "
                              f"brackets, commas or spaces, e.g. 'key=[1, 2]' or key=\"a b\")") from None


def load_experiment(experiment: str, overrides: list[str]) -> ExperimentConfig:
    return config_mod.load(compose(experiment, overrides))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollhpc")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "(not installed)"


def print_config(cfg: ExperimentConfig) -> int:
    print(yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False), end="")
    return 0


def _prepare_run_dir(cfg: ExperimentConfig, plan, overwrite: bool, resume: bool = False) -> Path:
    run_dir = cfg.run.run_dir.resolve()
    if resume:
        return _resume_run_dir(cfg, plan, run_dir)
    if run_dir.exists():
        if not overwrite:
            raise ConfigError(f"run directory {run_dir} exists; pick another run.name=..., pass --resume to "
                              "continue it from its checkpoint, or --overwrite to start again")
        shutil.rmtree(run_dir)
    RunPaths(run_dir).logs.mkdir(parents=True)
    atomic_write_text(RunPaths(run_dir).config, yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False))
    plan.save(RunPaths(run_dir).plan)
    return run_dir


def _resume_run_dir(cfg: ExperimentConfig, plan, run_dir: Path) -> Path:
    """An existing run continues only with the configuration it was started with (its checkpoint's layout
    and data cursor depend on it); the world's processes find its newest good checkpoint themselves."""
    saved_path = RunPaths(run_dir).config
    if not saved_path.is_file():
        raise ConfigError(f"--resume: {run_dir} is not a run directory (no config.yaml); start it without --resume")
    saved = yaml.safe_load(saved_path.read_text())
    now = yaml.safe_load(yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False))  # as config.yaml holds it
    # where the run directory is was settled by finding it (a relative output_dir depends on the cwd), and
    # the machines (cluster.*: partition, time limit, nodes) do not change what a checkpoint holds
    # and export_hf only decides what is written after the last step (resuming a finished run with export_hf=final
    # exports it)
    differ = sorted(k for k in _differing_keys(saved, now)
                    if k not in ("run.output_dir", "pipeline.options.export_hf") and not k.startswith("cluster."))
    if differ:
        raise ConfigError(f"--resume: the configuration differs from the run's {saved_path} in "
                          f"{', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}; resume with the same settings")
    RunPaths(run_dir).error.unlink(missing_ok=True)  # the last attempt's failure is history now
    if now != saved:
        from rollhpc.rundir import atomic_write_bytes

        atomic_write_bytes(saved_path, yaml.safe_dump(config_mod.to_dict(cfg), sort_keys=False).encode())
    plan.save(RunPaths(run_dir).plan)
    return run_dir


def _differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differing_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _prepare_inputs(cfg: ExperimentConfig) -> None:
    """Inputs the ranks load at start-up, made before any process starts (e.g. the quickstart's SFT
    warm start): the pipeline's ``prepare`` classmethod, when it has one."""
    pipeline_cls = config_mod.import_object(cfg.pipeline.entry, "pipeline.entry")
    prepare = getattr(pipeline_cls, "prepare", None)
    if prepare is not None:
        try:
            prepare(cfg.pipeline.options, cfg.run.seed, cfg.roles)
        except (FileExistsError, FileNotFoundError, ValueError) as e:  # ConfigError included
            raise ConfigError(f"preparing the run's inputs: {e}") from e


def _check_inputs(cfg: ExperimentConfig, refuse: bool) -> None:
    """Model directories the run would load (``config.missing_inputs``): a run started without one fails only
    once its world is up, so ``train`` and ``submit`` refuse it here; ``plan`` and ``--dry-run`` only print, for
    a model that may exist on the cluster alone, and warn."""
    problems = config_mod.missing_inputs(cfg)
    if problems and refuse:
        raise ConfigError("; ".join(problems))
    for problem in problems:
        print(f"rollhpc: warning: {problem}; train and submit refuse to start without it", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> int:
    from rollhpc.launch.local import build_command, failure_summary, local_plan, run_local
    from rollhpc.launch.requeue import EXIT_REQUEUE

    cfg = load_experiment(args.experiment, args.overrides)
    if args.print_config:
        return print_config(cfg)
    try:
        plan = local_plan(cfg)
    except ConfigError as e:
        if not args.dry_run:
            raise
        # a login node has no GPUs: the dry run still shows the command and the prompts, planned on cluster.*
        from rollhpc.placement.device_mapping import plan_world

        plan = plan_world(cfg)
        print(f"rollhpc: warning: {e}; planned on cluster.* instead (`rollhpc submit` runs it there)",
              file=sys.stderr)
    _check_inputs(cfg, refuse=not args.dry_run)
    if args.dry_run:
        print(" ".join(build_command(cfg, plan, cfg.run.run_dir.resolve())))
        preview = getattr(config_mod.import_object(cfg.pipeline.entry, "pipeline.entry"), "preview", None)
        if preview is not None:  # what the policy will be shown: chat template or plain text
            try:
                print("\n".join(preview(cfg.pipeline.options, roles=cfg.roles)))
            except ValueError as e:  # a prompt that leaves no room for its response
                raise ConfigError(f"pipeline.options.task: {e}") from None
        return 0
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    _prepare_inputs(cfg)
    run_dir = _prepare_run_dir(cfg, plan, args.overwrite, args.resume)
    print(f"rollhpc: run {cfg.run.name}: {cfg.world_size()} MPI ranks, output in {run_dir}", file=sys.stderr)
    rc = run_local(cfg, plan, run_dir)
    if rc == EXIT_REQUEUE:
        print(f"rollhpc: run {cfg.run.name} stopped after saving a checkpoint (stop request); continue it with the "
              f"same command and --resume", file=sys.stderr)
        return EXIT_REQUEUE
    if rc != 0 or RunPaths(run_dir).error.exists():
        print(f"rollhpc: run failed: {failure_summary(run_dir, rc)}", file=sys.stderr)
        return 1
    print(f"rollhpc: run {cfg.run.name} finished; metrics in {run_dir / 'metrics.jsonl'}", file=sys.stderr)
    return 0


def estimate_memory(cfg: Any, plan: Any) -> Any:
    from rollhpc.placement.memory_plan import estimate

    return estimate(cfg, plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from rollhpc.placement.device_mapping import plan_world
    from rollhpc.launch.plan_report import render

    cfg = load_experiment(args.experiment, args.overrides)
    if args.print_config:
        return print_config(cfg)
    plan = plan_world(cfg)
    _check_inputs(cfg, refuse=False)
    memory = estimate_memory(cfg, plan) if plan.gpus_total else None
    if args.json:
        print(plan.to_json())
    else:
        for line in render(cfg, plan, ranks=not args.no_ranks, groups=args.groups, max_groups=args.max_groups):
            print(line)
        for line in memory.render() if memory else ():
            print(line)
    if memory:
        memory.check()  # after the report, which shows where the memory goes
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from rollhpc.placement.device_mapping import plan_world
    from rollhpc.launch.local import failure_summary
    from rollhpc.launch.slurm import render_sbatch, submit, wait_for_job

    cfg = load_experiment(args.experiment, args.overrides)
    if args.print_config:
        return print_config(cfg)
    plan = plan_world(cfg)  # an impossible mapping fails here, before anything reaches Slurm
    if plan.gpus_total:
        estimate_memory(cfg, plan).check()  # so does one that cannot fit in cluster.gpu_memory_gb
    _check_inputs(cfg, refuse=not args.dry_run)
    if args.dry_run:
        print(render_sbatch(cfg, plan, cfg.run.run_dir.resolve()))
        return 0
    missing = [tool for tool in ("sbatch", "srun", "sacct") if not shutil.which(tool)]
    if missing:
        print(f"rollhpc submit: {', '.join(missing)} not found: run it on a Slurm login node (or add --dry-run "
              f"to see the batch script)", file=sys.stderr)
        return 2
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if args.resume:
        _refuse_if_job_active(cfg.run.run_dir.resolve())
    _prepare_inputs(cfg)
    run_dir = _prepare_run_dir(cfg, plan, args.overwrite, args.resume)
    job = submit(cfg, plan, run_dir)  # writes RUN_DIR/slurm/job_id and queues the job's rescue job
    print(f"rollhpc: submitted job {job.job_id}: {plan.world_size} ranks in {len(plan.components)} het group(s); "
          f"output in {run_dir}", file=sys.stderr)
    if not args.wait:
        return 0
    state = wait_for_job(job.job_id, release_held=cfg.cluster.release_held, run_dir=run_dir)
    if state != "COMPLETED" or RunPaths(run_dir).error.exists():
        print(f"rollhpc: job {job.job_id} ended {state}: {failure_summary(run_dir, 1)}", file=sys.stderr)
        return 1
    print(f"rollhpc: job {job.job_id} completed; metrics in {run_dir / 'metrics.jsonl'}", file=sys.stderr)
    return 0


def _refuse_if_job_active(run_dir: Path) -> None:
    """Two jobs must never write one run directory: a resubmission waits until the last job has ended."""
    from rollhpc.launch.slurm_cli import TERMINAL, component_states

    id_file = RunPaths(run_dir).job_id
    if not id_file.is_file():
        return
    job_id = id_file.read_text().strip()
    active = {c: st for c, st in component_states(job_id).items() if st not in TERMINAL}
    if active:
        raise ConfigError(f"--resume: job {job_id} of {run_dir} is still {sorted(set(active.values()))[0]} (it "
                          f"continues the run by itself after a time limit or a lost node); wait for it to end or "
                          f"`scancel {job_id}` first")


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from rollhpc.launch import status

    try:
        run_dir = status.check_run_dir(args.run_dir)
    except status.NotARunDirectory as e:
        print(f"rollhpc status: {e}", file=sys.stderr)
        return 2
    job_id = status.job_id_of(run_dir)
    from rollhpc.launch.resubmit import rescue_jobs

    rescue_id = rescue_jobs(run_dir).get(job_id) if job_id else None
    report = status.build_report(run_dir, job_id, None if job_id is None else status.query_slurm(job_id),
                                 rescue_id=rescue_id, rescue=status.query_slurm(rescue_id) if rescue_id else None)
    print(json.dumps(report, indent=1) if args.json else "\n".join(status.render(report)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rollhpc.observability.report import summarize, load_run, write_report

    try:
        runs = [load_run(d) for d in args.run_dirs]
    except FileNotFoundError as e:
        print(f"rollhpc report: {e}", file=sys.stderr)
        return 2
    out = args.out or args.run_dirs[0] / "report"
    written = write_report(args.run_dirs, out)
    for run in runs:
        print("\n".join(summarize(run)))
    print(f"rollhpc report: {', '.join(p.name for p in written)} in {out}", file=sys.stderr)
    return 0


def _sft_settings(pairs: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """KEY=VALUE (YAML values) -> (task options, spec.KEY fields, sft.KEY fields)."""
    from dataclasses import fields

    from rollhpc.models.sft import SftOptions
    from rollhpc.models.tiny import TinyModelSpec

    task: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {"spec": {}, "sft": {}}
    allowed = {"spec": {f.name for f in fields(TinyModelSpec)}, "sft": {f.name for f in fields(SftOptions)}}
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
            hint = (f"{group}.* fields: {', '.join(sorted(allowed[group]))}" if group in allowed
                    else "use KEY (task option), spec.KEY or sft.KEY")
            raise ConfigError(f"unknown setting {key!r}; {hint}")
    return task, nested["spec"], nested["sft"]


def _accuracy_or_none(text: str) -> float | str:
    try:
        return text if text == "none" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] or 'none', got {text!r}") from None


def cmd_sft(args: argparse.Namespace) -> int:
    import logging

    from rollhpc.models.policy_prep import prepare_policy, read_report
    from rollhpc.models.sft import SftOptions
    from rollhpc.models.tiny import TinyModelSpec

    logging.basicConfig(level=logging.INFO, format="rollhpc: %(message)s")
    from rollhpc.tasks import task_module

    try:
        task_module(args.task)
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None
    task_opts, spec_kw, sft_kw = _sft_settings(args.overrides)
    flags = {"steps": args.steps, "lr": args.lr, "batch_size": args.batch_size}
    sft_kw |= {k: v for k, v in flags.items() if v is not None}
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.target_accuracy is not None:
            sft_kw["target_accuracy"] = None if args.target_accuracy == "none" else args.target_accuracy
        spec, sft = TinyModelSpec(**spec_kw), SftOptions(**sft_kw)
        out = prepare_policy(args.out_dir, task=args.task, task_options=task_opts, spec=spec, sft=sft, seed=args.seed,
                             vocab_size=args.vocab_size, progress=not args.quiet)
    except (ValueError, TypeError, FileExistsError) as e:
        raise ConfigError(str(e)) from e
    report = read_report(out)
    print(f"rollhpc: policy {out}: held-out greedy accuracy {report['heldout_accuracy']:.3f} after "
          f"{report['steps']} SFT steps ({report['wall_s']:.0f} s to prepare)", file=sys.stderr)
    print(out)
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from rollhpc.checkpoint import report
    from rollhpc.checkpoint.storage import CheckpointStorageError

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


def cmd_convert(args: argparse.Namespace) -> int:
    return convert_cli.run(args)


def cmd_export(args: argparse.Namespace) -> int:
    from rollhpc.checkpoint import export

    return export.run(args)


def cmd_sandbox(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from rollhpc.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
    from rollhpc.sandbox import selfcheck

    try:
        if args.sandbox_command == "check":
            sandbox = Sandbox(selfcheck.CHECK_LIMITS)
            print(sandbox.describe())
            results = selfcheck.run_checks(sandbox)
            print("\n".join(selfcheck.render(results, verbose=args.verbose)))
            return 0 if all(r.ok for r in results) else 1
        changes = {k: v for k, v in (("wall_s", args.timeout), ("memory_mb", args.memory_mb)) if v is not None}
        stdin = "" if args.stdin is None else sys.stdin.read() if str(args.stdin) == "-" else args.stdin.read_text()
        result = Sandbox(replace(SandboxLimits(), **changes)).run(args.file.read_text(), stdin)
    except SandboxUnavailable as e:
        print(f"NOT isolated  sandbox unavailable: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"rollhpc sandbox {args.sandbox_command}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(result.render()))
    return 0 if result.ok else 1


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
    from rollhpc.envs.episodes import run_episodes
    from rollhpc.sandbox import SandboxUnavailable

    options = _env_options(args.option or [])
    try:
        stats = run_episodes(args.name, options, args.policy, args.episodes, args.seed, args.max_new_tokens)
    except (ValueError, SandboxUnavailable) as e:
        print(f"rollhpc env: {e}", file=sys.stderr)
        return 2
    print(stats.summary())
    if args.show:
        print(stats.transcripts[0].render())
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    found = experiments.available()
    width = max((len(e.name) for e in found), default=0)
    for e in found:
        print(f"{e.name:<{width}}  {e.description}" + (f"  [{e.path}]" if args.paths else ""))
    print("searched, first match wins: " + ", ".join(str(d) for d in experiments.search_path()), file=sys.stderr)
    return 0


def cmd_not_yet(args: argparse.Namespace) -> int:
    print(f"rollhpc {args.command}: not implemented in this version of rollhpc yet", file=sys.stderr)
    return 2


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

    def experiment_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("experiment", help="experiment name (`rollhpc configs` lists them) or path to a .yaml")
        sp.add_argument("overrides", nargs="*", help="hydra overrides, key=value")
        sp.add_argument("--print-config", action="store_true", help="print the resolved configuration (the YAML "
                        "with the overrides applied and every default filled in, as the run's config.yaml will "
                        "hold it) and exit")

    cf = sub.add_parser("configs", help="list the experiments found by name, one line each",
                        description="List every experiment NAME that `rollhpc train NAME` finds, with the first "
                        "sentence of its leading comment. Searched in order, first match wins: ./configs/, each "
                        "folder of ROLLHPC_CONFIG_PATH (':'-separated), then the configs rollhpc ships (configs/ "
                        "of a source checkout, or the copy `pip install` puts under PREFIX/share/rollhpc/configs).")
    cf.add_argument("--paths", action="store_true", help="also print each experiment's file")
    cf.set_defaults(func=cmd_configs)

    t = sub.add_parser("train", help="run an experiment here, as one MPI world started with mpiexec",
                       description="Run an experiment on this machine: rank 0 is the controller, the other "
                       "ranks serve the configured roles. Writes runs/NAME/ (config.yaml, metrics.jsonl, "
                       "logs/ per rank, error.json on failure).")
    experiment_args(t)
    t.add_argument("--dry-run", action="store_true", help="print the mpiexec command and the first prompts as the "
                   "policy will see them (chat template or plain text), then exit")
    t.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same name")
    t.add_argument("--resume", action="store_true",
                   help="continue an existing run directory (same configuration) from its newest good checkpoint; "
                   "SIGUSR1 to this command makes the run checkpoint after its current step and stop (exit 75)")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plan", help="print where every rank of every role runs (node, GPUs, het group) and its "
                        "parallel groups", description="Validate an experiment's device mapping against its cluster "
                        "description (cluster.nodes, cluster.gpus_per_node, ...) and print the plan, without "
                        "starting or submitting anything. Impossible mappings fail with one message. For GPU roles "
                        "it also estimates each GPU's memory stage by stage (generate, reference, train, weight "
                        "sync...), with colocated roles all resident (offload off) and taking turns (offload on), "
                        "from the models' config.json; with cluster.gpu_memory_gb set, a mapping whose peak "
                        "exceeds it even with offload is refused here and by submit.")
    experiment_args(pl)
    pl.add_argument("--groups", action="store_true", help="also print each role's parallel groups (tp, cp, dp, pp, ...)")
    pl.add_argument("--max-groups", type=int, default=4, help="groups shown per kind (0 = all; default 4)")
    pl.add_argument("--no-ranks", action="store_true", help="omit the per-rank table")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    sb = sub.add_parser("submit", help="submit an experiment to Slurm as one heterogeneous job",
                        description="Plan the experiment on cluster.* (nodes, GPUs per node, partition...), then "
                        "submit one heterogeneous Slurm job (one component per placement group) whose single MPMD "
                        "srun starts the controller and every worker in one MPI world. Run from a login node; "
                        "runs/NAME must be on a filesystem the compute nodes share.")
    experiment_args(sb)
    sb.add_argument("--dry-run", action="store_true", help="print the sbatch script and exit")
    sb.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 only if the run succeeded")
    sb.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same name")
    sb.add_argument("--resume", action="store_true",
                    help="submit a new job for an existing run directory (same configuration; its last job must have "
                    "ended) that continues from the newest good checkpoint. Not needed after a time limit or a "
                    "node failure: the job requeues itself (cluster.requeue, cluster.max_restarts)")
    sb.set_defaults(func=cmd_submit)

    st = sub.add_parser("status", help="where a run stands: its Slurm job, step, restarts, checkpoint, and what to do",
                        description="Report on a run directory: its Slurm job (each het component's state, nodes and "
                        "pending reason, from scontrol, or sacct once scontrol has forgotten it), the last step in "
                        "metrics.jsonl against pipeline.options.steps, the restarts in restarts.jsonl, the checkpoint "
                        "a resume would use, error.json's summary, and what to do: release a job Slurm holds "
                        "(`scontrol release JOBID`), continue one that failed or ran out of restarts "
                        "(`slurm/resume.sh RUN_DIR`), or nothing. Read-only; off a Slurm machine it reports the run "
                        "directory and says Slurm was not reachable.",
                        epilog="Exit status: 0, or 2 when RUN_DIR is not a run directory (no config.yaml).")
    st.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's directory, runs/NAME")
    st.add_argument("--json", action="store_true", help="print the same report as JSON")
    st.set_defaults(func=cmd_status)

    rp = sub.add_parser("report", help="plots and a summary of one run, or several compared on the same axes",
                        description="Write PNG figures of a run (finished or in progress) and a text summary: "
                        "learning.png (reward and held-out accuracy against step and against wall time, restarts "
                        "and requeues from restarts.jsonl marked as dashed lines), throughput.png (tokens/s, the "
                        "generators' idle fraction), stages.png (each step's time by stage: rollout, old "
                        "log-probs, reference, train, weight sync, evaluation, the rest), training.png (loss, "
                        "gradient norm, clip fraction, response length, entropy, KL: each one logged, raw and "
                        "smoothed), summary.txt. Given several runs, each curve is one run (named by its "
                        "directory where two share a name). Files are replaced atomically.",
                        epilog="Example: rollhpc report runs/quickstart runs/quickstart_pp2 --out cmp/. "
                        "Exit status: 0, or 2 when a RUN_DIR has no metrics.jsonl.")
    rp.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directories, runs/NAME")
    rp.add_argument("--out", type=Path, metavar="DIR", help="where the files go (default: FIRST_RUN_DIR/report)")
    rp.set_defaults(func=cmd_report)

    from rollhpc.models.sft import SftOptions
    from rollhpc.tasks import available_tasks

    sft = SftOptions()
    sf = sub.add_parser("sft", help="prepare the RL starting policy: a tiny Qwen2 model fine-tuned on a task",
                        description="Train a tokenizer on the task's train split, create a tiny Qwen2 model and "
                        "fine-tune it until its greedy accuracy on training examples reaches sft.target_accuracy "
                        "(or for --steps), then write OUT_DIR as a Hugging Face model directory with "
                        "sft_report.json (steps, losses, held-out greedy accuracy, time, settings). OUT_DIR "
                        "appears complete or not at all; if it exists with the same settings it is reused, with "
                        "other settings it is an error.",
                        epilog="Settings are KEY=VALUE (YAML values): a plain KEY is a task option (arithmetic: "
                        "digits, ops, allow_negative; countdown: num_numbers, max_number, max_target), spec.KEY a "
                        "model size (rollhpc.models.tiny.TinyModelSpec), sft.KEY an SFT option "
                        "(rollhpc.models.sft.SftOptions). Example: `rollhpc sft policies/add3 digits=3 "
                        "'ops=[+, -]' spec.num_hidden_layers=3 --steps 2000`.")
    sf.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to write (or reuse)")
    sf.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="task options, spec.KEY, sft.KEY")
    sf.add_argument("--task", default="arithmetic", metavar="NAME",
                    help=f"a task of rollhpc.tasks ({', '.join(available_tasks())}) or a task module's import path "
                         "(package.module); default: arithmetic")
    sf.add_argument("--seed", type=int, default=0, help="seeds the splits, the initial weights and the batch order")
    sf.add_argument("--steps", type=int, help=f"most SFT steps (default {sft.steps}; the target accuracy stops sooner)")
    sf.add_argument("--lr", type=float, help=f"peak learning rate (default {sft.lr:g})")
    sf.add_argument("--batch-size", type=int, help=f"examples per step (default {sft.batch_size})")
    sf.add_argument("--target-accuracy", metavar="X", type=_accuracy_or_none, help="stop at this greedy accuracy on "
                    f"training examples (default {sft.target_accuracy}; 'none' trains all --steps)")
    sf.add_argument("--vocab-size", type=int, default=512, help="tokenizer size ceiling (default 512)")
    sf.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sf.add_argument("--quiet", action="store_true", help="no progress bar")
    sf.set_defaults(func=cmd_sft)

    cv = sub.add_parser("convert", help="convert checkpoints between Hugging Face and Megatron formats",
                        description="Convert a Hugging Face safetensors model to a megatron-core dist checkpoint "
                        "(hf-to-mcore, at any TP/PP/EP layout) or back (mcore-to-hf). Runs here, in local worker "
                        "processes; slurm/convert.sh runs it as a batch job.")
    convert_cli.add_arguments(cv)
    cv.set_defaults(func=cmd_convert)

    from rollhpc.checkpoint import export

    ex = sub.add_parser("export", help="a run's trained model as a Hugging Face directory (safetensors, config, "
                        "tokenizer, generation config)",
                        description="Write OUT_DIR, a Hugging Face model directory that transformers and vLLM load, "
                        "from the trainer's model of a run's checkpoint (RUN_DIR/checkpoints/step_N/train/model): "
                        "by default the newest good checkpoint, the one a resume would use; with --step N that "
                        "step's. Dense and MoE models; safetensors, config.json, and the tokenizer and generation "
                        "config of the model the run started from (one derived from config.json where it had "
                        "none). Runs here, in a local worker process, one tensor at a time; OUT_DIR appears complete "
                        "or not at all.", epilog=export.EPILOG)
    export.add_arguments(ex)
    ex.set_defaults(func=cmd_export)

    ck = sub.add_parser("ckpt", help="list, inspect and verify a run's checkpoints",
                        description="Read-only views of RUN_DIR/checkpoints/ (step_N/ directories with a "
                        "manifest.json of every file's size and sha256, and a `latest` pointer). Safe to run "
                        "while the run writes. PATH may be a run directory, its checkpoints/ folder or one "
                        "checkpoint directory.")
    cks = ck.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    c = cks.add_parser("list", help="one row per checkpoint: step, time, size, status, which is latest",
                       description="Status: ok (files match the manifest), corrupt (a file is missing, resized, "
                       "added, or with --deep has another sha256), partial (never committed: being written, or "
                       "left by a crash; ignored on resume). The last line says which checkpoint a resume uses.")
    c.add_argument("path", type=Path, metavar="PATH", help="run directory or checkpoints/ folder")
    c.add_argument("--deep", action="store_true", help="also compare every file's sha256 (reads everything)")
    c = cks.add_parser("inspect", help="one checkpoint: manifest summary, meta, optimizer state, files by size, "
                       "tensor shapes",
                       description="Print a checkpoint's step, time, size and status, its meta (JSON given at "
                       "commit), per trainer role (train, critic) its optimizer: the stack that saved it (megatron's "
                       "distributed optimizer, megatron's optimizer without it, or older runs' torch AdamW), the "
                       "ranks that saved it and their TP/PP/DP, the optimizer step, the format and whether it loads "
                       "at another layout, and per kind of state (main params, exp_avg, exp_avg_sq) its tensors, "
                       "elements, dtype and bytes, the shard files and their bytes on disk; then its files largest "
                       "first, and the tensor names, dtypes and shapes of its .safetensors (header only) and .pt "
                       "files. A run directory shows the checkpoint `latest` names. Reads files only, builds no "
                       "model.")
    c.add_argument("path", type=Path, metavar="PATH", help="checkpoint directory (or run directory: latest)")
    c.add_argument("--max-files", type=int, default=20, metavar="N", help="files listed (0 = all; default 20)")
    c = cks.add_parser("verify", help="check files against manifests; exit 0 if good, 1 with one line per problem",
                       description="Compare every file with its checkpoint's manifest (set of files, sizes; "
                       "sha256 with --deep). A run directory or checkpoints/ folder checks every committed "
                       "checkpoint and the `latest` pointer. Exit 0: good; 1: problems, one per line; 2: no "
                       "such path.")
    c.add_argument("path", type=Path, metavar="PATH", help="checkpoint directory, run directory or checkpoints/")
    c.add_argument("--deep", action="store_true", help="also compare every file's sha256 (reads everything)")
    ck.set_defaults(func=cmd_ckpt)

    sx = sub.add_parser("sandbox", help="run untrusted Python in a bubblewrap sandbox; check the isolation here",
                        description="The code sandbox reward functions and environments use (rollhpc.sandbox): "
                        "each program runs under bubblewrap in its own user, pid, network, mount, IPC and UTS "
                        "namespaces as uid 65534, with read-only system directories and interpreter, a private "
                        "tmpfs /tmp as the only writable place, no network but lo, no /etc, home or project "
                        "files, and limits on wall time, CPU time, memory, processes, open files, file size and "
                        "output. Without bwrap or user namespaces nothing runs: the error says what to install "
                        "or enable.")
    sxs = sx.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    c = sxs.add_parser("run", help="run FILE (Python) in a sandbox and print the result; exit 0 if its status is ok",
                       description="Run a Python program in a fresh sandbox with the default limits "
                       "(rollhpc.sandbox.SandboxLimits). Prints the status (ok, timeout, memory, output_limit, "
                       "killed, error) and why, exit code, wall and CPU time, then stdout and stderr (each cut at "
                       "64,000 bytes). Exit status: 0 if the program's status is ok, 1 otherwise, 2 if FILE "
                       "cannot be read.")
    c.add_argument("file", type=Path, metavar="FILE", help="the Python program")
    c.add_argument("--stdin", type=Path, metavar="FILE", help="file given to the program as stdin ('-': this stdin)")
    c.add_argument("--timeout", type=float, metavar="S", help="wall-clock limit in seconds (default 10)")
    c.add_argument("--memory-mb", type=int, metavar="M", help="address-space limit per process (default 512)")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c = sxs.add_parser("check", help="prove the isolation and limits on this machine: one line per check",
                       description="Run real programs in real sandboxes and check what they can do: non-root "
                       "uid; only lo, failing DNS, no connection to a listener on the host's 127.0.0.1; "
                       "/etc/shadow, the home directory and the project unreadable; no writes outside the "
                       "private /tmp; own pid namespace; process, memory, CPU-time and file-size limits hold; "
                       "nothing left running after the deadline. Prints `isolated` or `NOT isolated` per check. "
                       "Run it on each kind of compute node: `srun rollhpc sandbox check`.",
                       epilog="Exit status: 0 if every check passed, 1 if any failed or no sandbox can be made.")
    c.add_argument("--verbose", action="store_true", help="show what each check saw, not only failures")
    sx.set_defaults(func=cmd_sandbox)

    ev = sub.add_parser("env", help="play episodes of a text environment with a random, expert or model policy",
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
                        "unknown environment, bad options or policy, or no sandbox for a code-running environment.")
    ev.add_argument("name", metavar="NAME", help="environment: a short name or package.module:Class")
    ev.add_argument("--episodes", type=int, default=20, metavar="N", help="episodes to play (default 20)")
    ev.add_argument("--policy", default="random", metavar="POLICY",
                    help="random, expert or a model directory (default random)")
    ev.add_argument("--option", action="append", metavar="KEY=VALUE", help="an environment option (repeatable)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    ev.add_argument("--show", action="store_true", help="also print the first episode's transcript")
    ev.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                    help="a model policy's most tokens per turn (default 32)")
    ev.set_defaults(func=cmd_env)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come after flags (`train quickstart --overwrite a.b=1`): collect them too
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray and args.command != "convert":  # the subcommand's usage, which lists its flags
        parser.subcommands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(stray)}")
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"rollhpc: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
