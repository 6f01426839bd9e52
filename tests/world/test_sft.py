"""The SFT warm start: prepare_policy writes a loadable HF directory with a report, atomically and
deterministically, reuses it for the same settings and refuses it for others; `rollhpc sft` drives it."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # everything must come from the written directory

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollhpc.warm_start.policy_build import evaluate_greedy
from rollhpc.warm_start.policy_prep import (
    REPORT,
    policy_splits,
    prepare_policy,
    read_report,
    resolve_task_options,
    task_splits,
)
from rollhpc.warm_start.sft import SftConfig, lr_factor, train_sft
import rollhpc.warm_start.sft as sft_mod
from tests.support.processes import rollhpc

# One-digit sums (100 problems): the smallest setting that still exercises every stage.
TASK = {"digits": 1}
SFT = SftConfig(
    steps=30,
    batch_size=16,
    lr=3e-3,
    warmup=5,
    train_examples=64,
    eval_examples=16,
    max_new_tokens=4,
    target_accuracy=None,
)


def prepare(out_dir: Path, sft: SftConfig = SFT, **kw) -> Path:
    return prepare_policy(
        out_dir,
        task="arithmetic",
        task_options=TASK,
        sft=sft,
        seed=3,
        vocab_size=300,
        progress=False,
        **kw,
    )


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Iterator[Path]:
    threads = torch.get_num_threads()
    # the machine is shared; and the determinism check compares like with like
    torch.set_num_threads(1)
    yield prepare(tmp_path_factory.mktemp("sft") / "policy")
    torch.set_num_threads(threads)


def test_policy_loads_in_transformers_and_reports_its_training(policy):
    # no temp dir left beside it
    assert sorted(p.name for p in policy.parent.iterdir()) == ["policy"]
    model = AutoModelForCausalLM.from_pretrained(policy)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 0
    report = read_report(policy)
    # defaults merged, JSON types
    assert report["settings"]["task_options"] == {
        "digits": 1,
        "ops": ["+"],
    }
    assert (
        report["settings"]["sft"]["steps"] == report["steps"] == 30
        and report["settings"]["seed"] == 3
    )
    assert report["loss_final"] < report["loss_first"] / 2
    assert report["wall_s"] > 0 and not report["reached_target"]
    train, heldout = policy_splits(policy)
    assert (len(train), len(heldout)) == (64, 16)
    assert (
        heldout == task_splits("arithmetic", resolve_task_options("arithmetic", TASK), 3, 64, 16)[1]
    )
    # the saved weights are the evaluated ones
    assert (
        evaluate_greedy(policy, heldout, "arithmetic", max_new_tokens=4)
        == report["heldout_accuracy"]
    )


def test_same_settings_give_the_same_weights(policy, tmp_path):
    again = prepare(tmp_path / "again")
    first, second = load_file(policy / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_existing_policy_with_the_same_settings_is_reused_without_training(
    policy, monkeypatch, caplog
):
    monkeypatch.setattr(
        "rollhpc.warm_start.policy_build.train_sft", lambda *a, **k: pytest.fail("retrained")
    )
    before = (policy / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="rollhpc.sft"):
        assert prepare(policy) == policy
    assert time.perf_counter() - start < 1.0
    assert "reusing" in caplog.text
    assert (policy / "model.safetensors").stat().st_mtime_ns == before


def test_existing_directory_with_other_settings_is_refused(policy, tmp_path):
    with pytest.raises(
        FileExistsError, match=r"other settings \(differing: sft.steps\); remove it or choose"
    ):
        prepare(policy, sft=replace(SFT, steps=31))
    with pytest.raises(FileExistsError, match=r"differing: seed, task_options.digits"):
        prepare_policy(
            policy, task_options={"digits": 2}, sft=SFT, seed=4, vocab_size=300, progress=False
        )
    (tmp_path / "other").mkdir()
    with pytest.raises(FileExistsError, match="is not a policy written by rollhpc"):
        prepare(tmp_path / "other")


def test_a_crash_midway_leaves_no_directory(tmp_path, monkeypatch):
    calls = []
    real = sft_mod.completion_loss

    def failing(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("node lost")
        return real(model, batch)

    monkeypatch.setattr(sft_mod, "completion_loss", failing)
    with pytest.raises(RuntimeError, match="node lost"):
        prepare(tmp_path / "policy")
    assert list(tmp_path.iterdir()) == []


def test_training_stops_at_the_target_accuracy(policy, monkeypatch):
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(policy),
        AutoTokenizer.from_pretrained(policy),
    )
    accuracies = iter([0.05, 0.1, 0.25, 0.9])
    monkeypatch.setattr(sft_mod, "exact_match", lambda *a, **k: next(accuracies))
    pairs = [(f"{a} + 1 =", f" {a + 1}") for a in range(20)]
    options = SftConfig(steps=100, batch_size=4, check_every=2, target_accuracy=0.2, warmup=2)
    result = train_sft(model, tokenizer, pairs, options, monitor_pairs=pairs[:4], progress=False)
    assert (result.steps, result.reached_target, result.accuracy_curve) == (
        6,
        True,
        [(2, 0.05), (4, 0.1), (6, 0.25)],
    )
    with pytest.raises(ValueError, match="target_accuracy needs monitor_pairs"):
        train_sft(model, tokenizer, pairs, options, progress=False)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    o = SftConfig(steps=100, warmup=10, min_lr_ratio=0.1)
    assert lr_factor(0, o) == pytest.approx(0.1) and lr_factor(9, o) == 1.0
    assert lr_factor(50, o) < lr_factor(20, o) and lr_factor(99, o) == pytest.approx(0.1)
    assert lr_factor(0, SftConfig(steps=4, warmup=30)) == 0.25  # warmup never outlasts the run


def test_bad_options_are_refused_with_the_allowed_names():
    with pytest.raises(
        ValueError, match="unknown option.* digit for task 'arithmetic'; allowed: digits, ops"
    ):
        resolve_task_options("arithmetic", {"digit": 3})
    with pytest.raises(ValueError, match="unknown task 'algebra'"):
        resolve_task_options("algebra")
    with pytest.raises(ValueError, match="SftConfig.steps must be a positive int"):
        SftConfig(steps=0)
    with pytest.raises(ValueError, match="target_accuracy must be in"):
        SftConfig(target_accuracy=1.5)


def test_cli_help_and_errors(tmp_path):
    assert "sft" in rollhpc("--help", cwd=tmp_path).stdout
    res = rollhpc("sft", "--help", cwd=tmp_path)
    assert res.returncode == 0
    for text in (
        "OUT_DIR",
        "KEY=VALUE",
        "--steps",
        "--seed",
        "--task",
        "--target-accuracy",
        "sft_report.json",
    ):
        assert text in res.stdout
    res = rollhpc("sft", str(tmp_path / "p"), "spec.layers=3", cwd=tmp_path)
    assert (
        res.returncode == 2
        and "unknown setting 'spec.layers'; spec.* fields: hidden_size" in res.stderr
    )
    assert not (tmp_path / "p").exists()


def test_cli_prepares_a_policy(tmp_path):
    out = tmp_path / "p"
    res = rollhpc(
        "sft",
        str(out),
        "digits=1",
        "sft.train_examples=64",
        "sft.eval_examples=16",
        "sft.warmup=2",
        "--steps",
        "5",
        "--batch-size",
        "8",
        "--target-accuracy",
        "none",
        "--threads",
        "1",
        "--quiet",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    assert "held-out greedy accuracy" in res.stderr
    settings = json.loads((out / REPORT).read_text())["settings"]
    assert (
        settings["sft"]["steps"],
        settings["sft"]["batch_size"],
        settings["sft"]["target_accuracy"],
    ) == (5, 8, None)
