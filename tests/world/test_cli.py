"""The command line as a user meets it, and the quickstart job end to end."""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml

from rollhpc.observability.metrics import read_metrics
from tests.support.processes import REPO, assert_no_orphans, rollhpc


def test_help_lists_every_command(tmp_path):
    res = rollhpc("--help", cwd=tmp_path)
    assert res.returncode == 0
    for cmd in ("train", "plan", "submit", "status", "convert", "export", "ckpt"):
        assert cmd in res.stdout
    assert "--dry-run" in rollhpc("train", "--help", cwd=tmp_path).stdout


def test_plan_prints_every_rank(tmp_path):
    res = rollhpc(
        "plan", "toy_grpo", "roles.train.procs=4", "roles.train.parallel.tp=2", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("experiment toy_grpo: 7 MPI ranks, 0 GPUs; cluster: 1 nodes")
    train_rows = [line.split() for line in lines if " train " in line]
    # rank, role, group rank, het group, node, gpus, tp, cp, dp, pp
    assert [(r[0], r[6], r[8]) for r in train_rows] == [
        ("1", "0", "0"),
        ("2", "1", "0"),
        ("3", "0", "1"),
        ("4", "1", "1"),
    ]


def test_plan_places_gpu_roles_and_refuses_impossible_mappings(tmp_path):
    gpu = [
        "roles.train.gpus_per_proc=1",
        "roles.train.procs=8",
        "roles.generate.gpus_per_proc=2",
        "roles.generate.procs=2",
        "cluster.nodes=3",
        "cluster.gpus_per_node=4",
    ]
    res = rollhpc("plan", "toy_grpo", *gpu, "--no-ranks", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "het group 1: train | 2 node(s), 8 tasks (4/node), 4 GPUs/node" in res.stdout
    assert "het group 2: generate | 1 node(s), 2 tasks (2/node), 4 GPUs/node" in res.stdout
    res = rollhpc("plan", "toy_grpo", *gpu, "cluster.nodes=2", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "rollhpc: config error: roles.generate: needs 4 GPUs but the cluster has no 4 free "
        "GPUs left (8 in all: 2 nodes x 4; the roles ask for 12, colocated ones counted once)"
    )


def test_dry_run_prints_the_mpmd_command(tmp_path):
    res = rollhpc("train", "toy_grpo", "--dry-run", cwd=tmp_path)
    assert res.returncode == 0
    cmd = res.stdout.split()
    assert cmd[0].endswith(("mpiexec", "mpiexec.gforker")) and cmd.count(":") == 3
    assert cmd[cmd.index("-n") + 1] == "1" and "controller" in cmd


def test_config_error_is_one_clear_line_and_starts_nothing(tmp_path):
    res = rollhpc("train", "toy_grpo", "+roles.train.parallel.tpp=2", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "rollhpc: config error: config.roles.train.parallel: unknown key 'tpp'; "
        "valid keys: tp, pp, cp, ep, etp, vpp, order"
    )
    assert not (tmp_path / "runs").exists()


def test_a_missing_model_directory_stops_train_and_submit_and_plan_warns(tmp_path):
    no_model = ["pipeline.options.model_dir=nowhere", "pipeline.options.warm_start=null"]
    refused = (
        f"rollhpc: config error: pipeline.options.model_dir, roles.train.options.model_dir, "
        f"roles.generate.options.model_dir, roles.reward.options.model_dir: no model directory at "
        f"{tmp_path.resolve() / 'nowhere'} (a Hugging Face checkpoint directory: point it at a local copy of "
        f"the model, build a tiny one with `rollhpc sft DIR` or set pipeline.options.warm_start to build it at "
        f"start)"
    )
    for command in ("train", "submit"):
        res = rollhpc(command, "quickstart", *no_model, cwd=tmp_path)
        assert (res.returncode, res.stderr.strip()) == (2, refused)
    assert not (tmp_path / "runs").exists()
    res = rollhpc("plan", "quickstart", *no_model, "--no-ranks", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout
    assert res.stderr.startswith(
        "rollhpc: warning: pipeline.options.model_dir, roles.train.options.model_dir"
    )


def test_existing_run_directory_is_not_overwritten_by_accident(tmp_path):
    (tmp_path / "runs" / "toy_grpo").mkdir(parents=True)
    res = rollhpc("train", "toy_grpo", cwd=tmp_path)
    assert (
        res.returncode == 2
        and "--overwrite to start again" in res.stderr
        and "--resume" in res.stderr
    )


def test_resume_refuses_a_changed_configuration(tmp_path):
    import yaml

    from rollhpc.cli.experiment import load_experiment
    from rollhpc.config import to_dict

    run_dir = tmp_path / "runs" / "toy_grpo"
    res = rollhpc("train", "toy_grpo", "--resume", cwd=tmp_path)
    assert res.returncode == 2 and "is not a run directory" in res.stderr
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(load_experiment("toy_grpo", []))))
    res = rollhpc("train", "toy_grpo", "--resume", "pipeline.options.steps=7", cwd=tmp_path)
    assert res.returncode == 2
    assert "differs from the run's" in res.stderr and "pipeline.options.steps" in res.stderr, (
        res.stderr
    )

    # export_hf only decides what is written after the last step: a resume may turn it on (a finished run resumed
    # with export_hf=final exports its final checkpoint), and config.yaml then says so
    from rollhpc.cli.experiment import resume_run_dir
    from rollhpc.placement.device_mapping import plan_world

    quick = tmp_path / "quickstart"
    quick.mkdir()
    (quick / "config.yaml").write_text(yaml.safe_dump(to_dict(load_experiment("quickstart", []))))
    cfg = load_experiment("quickstart", ["pipeline.options.export_hf=final"])
    assert resume_run_dir(cfg, plan_world(cfg), quick) == quick
    assert (
        yaml.safe_load((quick / "config.yaml").read_text())["pipeline"]["options"]["export_hf"]
        == "final"
    )


@pytest.mark.slow
def test_quickstart_learns(tmp_path):
    """... at umask 027, as on a project filesystem: the run directory is the group's to read, not the world's."""
    res = rollhpc(
        "train", "toy_grpo", cwd=tmp_path, timeout=600, preexec_fn=lambda: os.umask(0o027)
    )
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "runs" / "toy_grpo"
    metrics = read_metrics(run_dir / "metrics.jsonl")
    evals = [m["accuracy"] for m in metrics if "accuracy" in m]
    assert metrics[-1]["step"] == 200 and metrics[-1]["policy_version"] == 200
    assert evals[-1] >= 2 * evals[0] and evals[-1] >= 0.5, evals
    assert {"reward_mean", "generate_s", "train_s", "weight_sync_s"} <= set(metrics[-1])
    assert json.loads((run_dir / "launch.json").read_text())["command"]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "rank0-controller.log",
        "rank1-train.log",
        "rank2-train.log",
        "rank3-generate.log",
        "rank4-reward.log",
    ]
    assert_no_orphans(run_dir)
    report = rollhpc(
        "report", str(run_dir), cwd=tmp_path, timeout=300, preexec_fn=lambda: os.umask(0o027)
    )
    assert report.returncode == 0, report.stderr[-3000:]
    modes = {
        str(p.relative_to(run_dir)): stat.S_IMODE(p.stat().st_mode)
        for p in [run_dir, *run_dir.rglob("*")]
    }
    assert "report/learning.png" in modes and "config.yaml" in modes
    assert {
        k: m for k, m in modes.items() if m != (0o750 if (run_dir / k).is_dir() else 0o640)
    } == {}


def test_selfcheck_runs(tmp_path):
    res = rollhpc("train", "selfcheck", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "all checksums match" in res.stderr


def test_repo_layout_is_complete():
    for name in (
        "rollhpc",
        "slurm",
        "configs",
        "tools",
        "tests",
        "bench",
        "pyproject.toml",
        "README.md",
        "INSTALL.md",
        "Makefile",
        ".ci/run",
    ):
        assert (REPO / name).exists(), name


def test_plan_shows_what_each_pipeline_stage_holds(tmp_path, tiny_model):
    res = rollhpc(
        "plan",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "roles.train.procs=2",
        "roles.train.parallel.pp=2",
        "--no-ranks",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    at = lines.index(f"role train: 2 pipeline stages, 2 layers of {tiny_model}:")
    assert lines[at + 1 : at + 3] == [
        "  stage 0: embedding + layer 0",
        "  stage 1: layer 1 + final norm, output layer (a copy of the tied embedding)",
    ]
    res = rollhpc(
        "plan",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "roles.train.procs=2",
        "roles.train.parallel.pp=2",
        "roles.train.parallel.vpp=2",
        "--no-ranks",
        cwd=tmp_path,
    )
    assert (
        res.returncode == 2
        and res.stderr.startswith(  # refused at load, in one line, before anything starts
            "rollhpc: config error: roles.train.parallel: 2 layers cannot be split evenly into pp=2 x vpp=2 = 4 pipeline "
            "stages"
        )
    ), res.stderr


@pytest.mark.parametrize(
    "argv, files, expected",
    [
        (
            ["plan", "tab.yaml"],
            {"tab.yaml": "run:\n  name: x\n\tseed: 1\n"},
            "rollhpc: config error: tab.yaml:3:1: YAML syntax: found character '\\t' that cannot start any token (YAML "
            "indents with spaces, never tabs)",
        ),
        (
            ["train", "open.yaml"],
            {"open.yaml": "run: {name: x\nroles: {}\n"},
            "rollhpc: config error: open.yaml:2:6: YAML syntax: expected ',' or '}', but got ':'",
        ),
        (
            ["plan", "toy_grpo", "roles.trian.procs=2"],
            {},
            "rollhpc: config error: unknown role 'trian' (did you mean 'train'?); roles: generate, reward, train; a new "
            "role needs roles.trian.worker=package.module:Class",
        ),
        (
            ["submit", "toy_grpo", "pipeline.options.steps=[1,"],
            {},
            "rollhpc: config error: override 'pipeline.options.steps=[1,': ",
        ),
    ],
)
def test_yaml_override_and_role_mistakes_are_one_line_with_exit_2(
    tmp_path, monkeypatch, capsys, argv, files, expected
):
    from rollhpc.cli import main

    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_a_misspelt_flag_shows_usage_and_version_and_print_config(capsys):
    from rollhpc.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "toy_grpo", "--dryrun"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: rollhpc train [-h]" in err and "--dry-run" in err, err
    assert "unrecognized arguments: --dryrun" in err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("rollhpc ")
    for command in ("train", "plan", "submit"):
        assert main([command, "toy_grpo", "pipeline.options.steps=3", "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert (
            printed["pipeline"]["options"]["steps"] == 3
            and printed["controller"]["world_timeout_s"] == 180.0
        )


def test_a_gpu_config_dry_run_without_gpus_plans_on_its_cluster(tmp_path, monkeypatch, capsys):
    """A login node: `train --dry-run` of a GPU config shows its command, planned on cluster.*, and says so."""
    from rollhpc.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("rollhpc.launch.local.local_gpu_count", lambda: 0)
    assert main(["train", "qwen2.5-7b_grpo", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "cannot run on this machine (0 GPUs)" in err and "planned on cluster.* instead" in err
    assert "rollhpc.rank" in out and "prompts: not shown" in out
    # without --dry-run, nothing starts
    with pytest.raises(Exception, match="cannot run on this machine"):
        from rollhpc.cli.experiment import load_experiment
        from rollhpc.launch.local import local_plan

        local_plan(load_experiment("qwen2.5-7b_grpo", []))


def test_experiments_are_found_in_project_config_path_and_shipped(tmp_path, monkeypatch, capsys):
    """./configs first, then ROLLHPC_CONFIG_PATH, then the shipped configs (a source checkout's, or the copy a
    wheel installs under PREFIX/share/rollhpc/configs); `rollhpc configs` lists what a name finds."""
    from rollhpc import experiments
    from rollhpc.cli import main
    from rollhpc.cli.experiment import compose

    shipped = (REPO / "configs" / "toy_grpo.yaml").read_text()
    group = tmp_path / "group"
    group.mkdir()
    (group / "shared.yaml").write_text("# The group's shared run. More words.\n" + shipped)
    (group / "toy_grpo.yaml").write_text("# The group's own toy.\n" + shipped)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.yaml").write_text("# Mine.\n" + shipped)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(experiments.ENV_PATH, f"{tmp_path / 'absent'}:{group}")
    assert experiments.find("mine") == tmp_path / "configs" / "mine.yaml"
    # earlier in the path hides the shipped one
    assert experiments.find("toy_grpo") == group / "toy_grpo.yaml"
    assert experiments.find("quickstart") == REPO / "configs" / "quickstart.yaml"
    assert compose("shared", ["run.name=s"])["run"]["name"] == "s"
    assert main(["configs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["shared", "The", "group's", "shared", "run."] for line in out), out
    assert [line.split()[0] for line in out] == sorted(line.split()[0] for line in out) and len(
        out
    ) >= 14

    # a `pip install .`, no source checkout
    installed = tmp_path / "prefix" / "share" / "rollhpc" / "configs"
    installed.mkdir(parents=True)
    (installed / "quickstart.yaml").write_text(shipped)
    monkeypatch.setattr(experiments, "_SOURCE_CONFIGS", tmp_path / "no-checkout")
    monkeypatch.setattr(experiments, "_INSTALLED_CONFIGS", installed)
    assert experiments.find("quickstart") == installed / "quickstart.yaml"


@pytest.mark.slow
def test_the_wheel_installs_the_shipped_configs(tmp_path):
    """What puts them under PREFIX/share/rollhpc/configs: pyproject's data-files, checked in a real wheel."""
    import subprocess
    import sys
    import zipfile

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = tmp_path.glob("rollhpc-*.whl")
    names = {
        n.rsplit("/", 1)[-1]
        for n in zipfile.ZipFile(wheel).namelist()
        if "/data/share/rollhpc/configs/" in n
    }
    assert names == {p.name for p in (REPO / "configs").glob("*.yaml")}
