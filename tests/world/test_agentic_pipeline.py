"""The agentic pipeline on real processes: an MPI world of controller, Megatron trainer, vLLM generator and
the env role, playing ``tests.support.envs:MixedEnv`` (by seed: mostly well-behaved episodes, and ones whose
environment raises, hangs, returns garbage, dies or hangs in C code at its first step), with a random tiny
policy whose actions earn a reward half the time (odd length), so returns differ and the weights move. The
runs train with PPO: a critic role values each row's generated tokens (GAE) and trains beside the actor, so
its checkpoint is part of the resume too (GRPO on episode rows runs in the Slurm test).

One uninterrupted run (module fixture) is the reference: faulty episodes end alone and the run finishes with
nothing left behind; a run SIGKILLed after step 3 and resumed ends with exactly its weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollhpc.observability.metrics import read_metrics
from rollhpc.observability.rollouts import read_rollouts
from tests.support.processes import assert_no_orphans, cli_env, rollhpc
from tests.support.reports import assert_report
from tests.world.test_requeue import last_step, wait_for

STEPS = 5


def run_args(model: Path) -> list[str]:
    """Deterministic settings: one generator, no oversampling, no dynamic sampling, no redundancy."""
    return [
        f"pipeline.options.model_dir={model}",
        "pipeline.options.warm_start=null",
        f"pipeline.options.steps={STEPS}",
        "pipeline.options.groups_per_step=4",
        "pipeline.options.rollout.group_size=3",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.rollout.oversample=0",
        "pipeline.options.rollout.max_tokens=3",
        "pipeline.options.rollout.max_model_len=96",
        "pipeline.options.n_heldout=4",
        "pipeline.options.eval_every=0",
        "pipeline.options.checkpoint.every=2",
        "roles.train.options.lr=1e-3",
        "roles.generate.options.max_model_len=96",
        "roles.env.options.env=tests.support.envs:MixedEnv",
        "~roles.env.options.env_options",
        "+roles.env.options.env_options={max_steps: 2, reward: parity, kinds: [count, raise, count, hang, count, "
        "garbage, count, regex, count, crash, count, count]}",
        "roles.env.options.step_timeout_s=0.5",
        "roles.env.options.reset_timeout_s=2",
        "pipeline.options.algorithm=ppo",
        "pipeline.options.value_clip=null",
        "+roles.critic.worker=rollhpc.workers.megatron_policy:MegatronCriticWorker",
        "+roles.critic.procs=1",
        f"+roles.critic.options.model_dir={model}",
        "+roles.critic.options.lr=1e-3",
        "+roles.critic.options.threads=1",
        # the torch engine starts in a second where vLLM takes ~20 s (three runs here); multi-turn episodes on
        # vLLM: tests/world/test_slurm_submit.py's agentic run
        "roles.generate.options.engine=torch",
    ]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("agentic")
    res = rollhpc("train", "frozenlake", *run_args(tiny_model), cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return cwd / "runs" / "frozenlake"


@pytest.mark.slow
def test_faulty_episodes_end_alone_and_the_run_finishes(reference):
    metrics = read_metrics(reference / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))
    trained = metrics[1:]
    failed = {
        k.split("/", 1)[1]: sum(m.get(k, 0) for m in trained)
        for k in {k for m in trained for k in m if k.startswith("episodes_failed/")}
    }
    assert sum(m["episodes_failed"] for m in trained) == sum(failed.values()) > 0
    assert set(failed) <= {"error", "timeout", "invalid"} and len(failed) >= 2, failed
    # parity rewards of 2-turn episodes (failed ones 0)
    assert all(0 < m["reward_mean"] < 2 for m in trained)
    assert len({m["train/loss"] for m in trained}) > 1 and metrics[-1]["accuracy"] >= 0
    # nats per generated token, < log(vocab)
    assert all(0 < m["sampled_entropy"] < np.log(300) for m in trained)
    # counted turn by turn in test_agentic_scheduler
    assert all(0 <= m["turns_cut_frac"] <= 1 for m in trained)
    assert all(
        m["train/critic_value_loss"] > 0
        and m["train/critic_grad_norm"] > 0
        and m["critic_values_s"] > 0
        for m in trained
    )
    rollouts = read_rollouts(reference / "rollouts" / f"step_{STEPS:06d}.h5")
    for resp, mask, ends, rewards, finish in zip(
        rollouts["response_tokens"],
        rollouts["response_mask"],
        rollouts["turn_ends"],
        rollouts["turn_rewards"],
        rollouts["finish"],
    ):
        assert (
            len(mask) == len(resp) and len(ends) == len(rewards) and all(mask[e] == 1 for e in ends)
        )
        assert finish in ("terminated", "truncated", "row_full") or finish.split(":")[0] in (
            "error",
            "timeout",
            "invalid",
        )
    assert np.isin(rollouts["finish"], ["terminated"]).any()
    assert_no_orphans(reference)


@pytest.mark.slow
def test_a_killed_agentic_run_resumes_to_the_same_weights(tiny_model, reference, tmp_path):
    run_dir = tmp_path / "runs" / "frozenlake"
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollhpc.cli", "train", "frozenlake", *run_args(tiny_model)],
            cwd=tmp_path,
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for("step 3", lambda: last_step(run_dir) >= 3, 300, proc, log)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert_no_orphans(run_dir)
    res = rollhpc(
        "train", "--resume", "frozenlake", *run_args(tiny_model), cwd=tmp_path, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got, want = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(STEPS + 1)) and got[3]["restarts"] == 1
    assert [m.get("train/loss") for m in got] == [m.get("train/loss") for m in want]
    assert got[-1]["weights_sha256"] == want[-1]["weights_sha256"]
    # marked on the time axes
    assert "restarts: 1 (resume @ step " in assert_report(run_dir, tmp_path)
