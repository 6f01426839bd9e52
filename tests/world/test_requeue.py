"""Checkpoint-and-requeue on real processes: an RLVR run (Megatron trainer, vLLM generator) that is killed,
loses a node or hits its time limit resumes from its newest good checkpoint and ends with exactly the
weights of the same run left alone.

The uninterrupted reference runs once (module fixture); every interrupted run is compared with it: the sha256 of the final weights (full HF-named tensors), and the loss and
adaptive KL coefficient of every step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollhpc.launch.resubmit import rescue_jobs
from rollhpc.launch.slurm_cli import TERMINAL
from rollhpc.observability.metrics import read_metrics
from rollhpc.rundir import RunPaths, records
from rollhpc.rundir.records import read_events
from rollhpc.testing.fault_injection import CHECKPOINT_DELAY as DELAY_ENV
from rollhpc.testing.fault_injection import (
    HOLD_AFTER_CHECKPOINT,
    HOLD_IN_WEIGHT_SYNC,
    STALL_MPI_INIT,
)
from tests.support.processes import REPO, assert_no_orphans, cli_env, rank_processes, rollhpc

STEPS = 8
EXIT_REQUEUE = 75


def async_run(model: Path, steps: int) -> list[str]:
    """A short async GRPO run on the torch engine with a checkpoint every 2 steps: the next batch is generated while
    the trainer works, so a checkpoint also holds that batch. The entropy bonus gives every step a gradient."""
    return [
        f"pipeline.options.model_dir={model}",
        "pipeline.options.warm_start=null",
        f"pipeline.options.steps={steps}",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.rollout.oversample=0",
        "pipeline.options.checkpoint.every=2",
        "pipeline.options.loss.entropy_coef=0.05",
        "roles.train.options.lr=1e-3",
        "pipeline.options.rollout.max_staleness=1",
        "pipeline.options.old_logprob_source=generator",
        # the torch engine starts in a second where vLLM takes ~20 s, and every attempt of these runs starts
        # one; vLLM's own syncs and resumes are tested in tests/world/test_rlvr_pipeline.py and tests/world/test_cli.py
        "roles.generate.options.engine=torch",
    ]


def run_args(model: Path) -> list[str]:
    """``async_run`` of STEPS steps with a reference role, the KL in the reward under the adaptive controller and
    running reward normalisation. A random policy's verifier rewards are all 0, so the KL term and the entropy
    bonus drive the updates: each step depends on the sampled tokens, the optimizer moments, the KL coefficient,
    the reward moments and every RNG, which is what an exact resume must restore."""
    return [
        *async_run(model, STEPS),
        "pipeline.options.kl_in_reward=0.1",
        "pipeline.options.kl_control.kind=adaptive",
        "pipeline.options.kl_control.target=1e-4",
        "pipeline.options.kl_control.horizon=100",
        "pipeline.options.reward_norm.kind=running",
        "+roles.reference.worker=rollhpc.workers.megatron_policy:MegatronReferenceWorker",
        f"+roles.reference.options.model_dir={model}",
    ]


def trajectory(metrics: list[dict]) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["train/loss"], m["kl_scale"]) for m in metrics if "train/loss" in m}


def assert_same_as_uninterrupted(run_dir: Path, reference: list[dict]) -> list[dict]:
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS + 1)), (
        "every step exactly once after the resume"
    )
    assert trajectory(metrics) == trajectory(reference)
    assert metrics[-1]["weights_sha256"] == reference[-1]["weights_sha256"]
    return metrics


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    metrics = read_metrics(path) if path.exists() else []
    return metrics[-1]["step"] if metrics else -1


def wait_for(
    what: str,
    check,
    timeout: float,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
    run_dir: Path | None = None,
):
    """check()'s first true value within timeout; on failure the log's tail, or a Slurm run's restarts and job
    output (RUN_DIR), say what happened instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    if run_dir is not None:
        tail += run_story(run_dir)
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


# -- the pieces, without a run -------------------------------------------------------------------------


def test_prompt_stream_resumes_where_it_stopped():
    from rollhpc.pipelines.rlvr import PromptStream
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 7, 3, digits=2, ops=("+",))
    a = PromptStream(train, lambda ex: [ord(c) for c in ex.prompt], seed=3)
    head = [next(a) for _ in range(10)]  # past the end of an epoch: a reshuffle happened
    state = a.state_dict()
    rest = [next(a) for _ in range(9)]
    b = PromptStream(train, lambda ex: [ord(c) for c in ex.prompt], seed=99)
    b.load_state_dict(state)
    assert [p.uid for p in head] == list(range(10))
    assert [(p.uid, p.tokens) for p in (next(b) for _ in range(9))] == [
        (p.uid, p.tokens) for p in rest
    ]
    with pytest.raises(ValueError, match="resume with the task settings"):
        PromptStream(train[:5], str, seed=3).load_state_dict(state)


def test_truncate_metrics_keeps_steps_to_the_checkpoint_drops_torn_line(tmp_path):
    from rollhpc.observability.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": i, "x": i}) + "\n" for i in range(6)) + '{"step": 6, "x"'
    )
    assert truncate_metrics(path, 3) == 3
    assert [m["step"] for m in read_metrics(path)] == [0, 1, 2, 3]
    assert truncate_metrics(tmp_path / "missing.jsonl", 3) == 0


def test_requeue_log_and_decisions_without_slurm(tmp_path, monkeypatch, capsys):
    from rollhpc.launch import requeue

    for var in ("SLURM_JOB_ID", "SLURM_HET_SIZE", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    assert requeue.main(["start", str(tmp_path)]) == 0
    assert requeue.main(["start", str(tmp_path)]) == 0  # the first attempt ended without a word
    with open(tmp_path / RunPaths.RESTARTS, "a") as f:
        f.write('{"event": "requ')  # a line torn by a kill is skipped
    starts_ = [e for e in read_events(tmp_path) if e["event"] == "start"]
    assert (
        starts_[0]["previous_attempt"] is None
        and "killed without a report" in starts_[1]["previous_attempt"]
    )
    records.record_failed_node(tmp_path, "node2", "rank 3 died")
    records.record_failed_node(tmp_path, "node4", "rank 5 died")
    assert set(json.loads((tmp_path / RunPaths.FAILED_NODES).read_text())) == {"node2", "node4"}
    (tmp_path / "world.json").write_text("[]")  # the attempts below formed their world
    # outside a Slurm job nothing can be requeued: the status passes through and the end is logged
    assert requeue.main(["after", str(tmp_path), "75"]) == 75
    assert requeue.main(["after", str(tmp_path), "0"]) == 0
    # a lost worker after max_restarts restarts after failures: give up (no scontrol is called)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    for _ in range(2):
        records.log_event(tmp_path, {"event": "requeue", "cause": "failure", "reason": "lost"})
    assert (
        requeue.main(["after", str(tmp_path), str(requeue.EXIT_WORKER_LOST), "--max-restarts", "2"])
        == 76
    )
    # srun's status is the worst of all tasks (a killed worker's 137): the controller's own status decides
    records.record_controller_exit(tmp_path, requeue.EXIT_WORKER_LOST)
    assert records.controller_exit(tmp_path) == 76
    assert requeue.main(["after", str(tmp_path), "137", "--max-restarts", "2"]) == 76
    # the next attempt: the file speaks of an earlier one
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert records.controller_exit(tmp_path) is None
    assert requeue.main(["after", str(tmp_path), "137"]) == 137
    # cluster.requeue=false
    assert requeue.main(["after", str(tmp_path), "75", "--no-requeue"]) == 75
    ends = [e for e in read_events(tmp_path) if e["event"] == "end"]
    assert [e["status"] for e in ends] == [75, 0, 76, 76, 137, 75] and "giving up" in ends[2][
        "reason"
    ]
    assert "slurm/resume.sh" in ends[-1]["reason"]
    assert all(line.strip() for line in (tmp_path / RunPaths.RESTARTS).read_text().splitlines())


def test_continuations_after_time_limits_do_not_use_up_max_restarts(tmp_path, monkeypatch, capsys):
    """A run's restarts are counted by cause from its events (restarts.jsonl): thirteen continuations after a
    time limit (a four-week run of 48-hour jobs; one of them recorded before causes were, known by its reason)
    leave max_restarts=1 whole, so the first lost node restarts the run; the second failure ends it. A site's
    max_continuations ends a run at its next time limit once reached. ``rollhpc status`` names the bound."""
    from rollhpc.launch import requeue, status

    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("ROLLHPC_RESTART_BASE", "13")  # this is the run's 14th job
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    (tmp_path / "world.json").write_text("[]")  # every attempt below formed its world
    continued = {"event": "requeue", "reason": "checkpoint saved at the time-limit warning"}
    records.log_event(tmp_path, continued)  # no cause: an event of an older rollhpc
    for _ in range(12):
        records.log_event(tmp_path, {**continued, "cause": "continuation"})
    restarts: list[tuple[str, str]] = []

    def restart(run_dir, job_id, reason, exclude, failure=None, cause="failure"):
        restarts.append((reason, cause))
        records.log_event(run_dir, {"event": "requeue", "cause": cause, "reason": reason})
        return 0

    monkeypatch.setattr(requeue, "restart", restart)
    lost = ["after", str(tmp_path), str(requeue.EXIT_WORKER_LOST), "--max-restarts", "1"]
    assert requeue.main(lost) == 0 and restarts[-1][1] == "failure"
    assert records.restarts_by_cause(read_events(tmp_path)) == {
        "failure": 1,
        "continuation": 13,
    }
    assert requeue.main(lost) == requeue.EXIT_WORKER_LOST  # the second failure: out of restarts
    end = read_events(tmp_path)[-1]
    assert end["bound"] == "max_restarts" and "restarted 1 times after failures" in end["reason"]
    assert "its 13 continuation(s) after a time limit do not count" in end["reason"]
    report = status.build_report(tmp_path, None, None)
    assert report["state"] == "gave_up" and report["advice"][0].startswith(
        "out of restarts after failures (cluster.max_restarts)"
    )
    assert (report["restarts"]["failures"], report["restarts"]["continuations"]) == (1, 13)
    # a time limit: continued without a bound, ended at a site's
    at_limit = ["after", str(tmp_path), str(requeue.EXIT_REQUEUE)]
    assert requeue.main(at_limit) == 0 and restarts[-1][1] == "continuation"
    assert requeue.main([*at_limit, "--max-continuations", "14"]) == requeue.EXIT_REQUEUE
    end = read_events(tmp_path)[-1]
    assert end["bound"] == "max_continuations" and "slurm/resume.sh" in end["reason"]
    report = status.build_report(tmp_path, None, None)
    assert report["advice"][0].startswith("out of continuations (cluster.max_continuations)")


def test_a_lost_peer_restarts_until_it_repeats_and_an_own_error_ends_it(tmp_path, monkeypatch):
    """The batch script's side of the controller's verdict (rollhpc.controller.failure): a lost peer with no
    node to blame restarts without excluding any; the same failure at the same step right after a restart is
    deterministic and ends the run; an error of the run's own code ends it at once, and says why."""
    from rollhpc.launch import requeue

    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("ROLLHPC_RESTART_BASE", raising=False)
    monkeypatch.setattr(requeue, "excluded_nodes", lambda comp: set())
    submitted = []
    monkeypatch.setattr(
        requeue, "resubmit", lambda run_dir, exclude, n: (submitted.append(exclude), ("124", ""))[1]
    )
    (tmp_path / "world.json").write_text("[]")
    sig = "lost_peer|generate|receive_weights|RuntimeError|Connection closed by peer|5"
    peer = {
        "kind": "lost_peer",
        "summary": "gloo: Connection closed by peer",
        "signature": sig,
        "step": 5,
    }
    records.record_controller_exit(tmp_path, requeue.EXIT_WORKER_LOST, peer)
    assert requeue.main(["after", str(tmp_path), "1"]) == 0
    (requeue_event,) = [e for e in read_events(tmp_path) if e["event"] == "requeue"]
    assert submitted == [set()] and requeue_event["failure"]["kind"] == "lost_peer"
    assert requeue_event["reason"].startswith("a lost peer: gloo: Connection closed by peer")
    # the restarted attempt meets it again, at the same step
    monkeypatch.setenv("ROLLHPC_RESTART_BASE", "1")
    records.record_controller_exit(tmp_path, requeue.EXIT_WORKER_LOST, peer)
    assert (
        requeue.main(["after", str(tmp_path), "1"]) == requeue.EXIT_WORKER_LOST
        and len(submitted) == 1
    )
    end = read_events(tmp_path)[-1]
    assert (
        end["event"] == "end"
        and end["final"]
        and "the same failure twice in a row at step 5" in end["reason"]
    )
    # the same error at a later step is another occurrence
    monkeypatch.setenv("ROLLHPC_RESTART_BASE", "2")
    records.record_controller_exit(
        tmp_path, requeue.EXIT_WORKER_LOST, {**peer, "signature": sig[:-1] + "7"}
    )
    assert requeue.main(["after", str(tmp_path), "1"]) == 0 and len(submitted) == 2
    monkeypatch.setenv("ROLLHPC_RESTART_BASE", "3")
    records.record_controller_exit(
        tmp_path, 1, {"kind": "error", "summary": "ValueError: bad row", "signature": "x"}
    )
    assert requeue.main(["after", str(tmp_path), "1"]) == 1 and len(submitted) == 2
    end = read_events(tmp_path)[-1]
    assert end["final"] and end["failure"]["kind"] == "error" and "not restarted" in end["reason"]


def test_the_rescue_job_continues_only_a_run_nobody_else_continues(tmp_path, monkeypatch, capsys):
    """rollhpc.launch.rescue's decisions, Slurm's answers stood in for (the chaos tests below run real rescues):
    a het job whose components ended NODE_FAIL and COMPLETING is continued, excluding the lost nodes so far; a
    finished run, a run ended on purpose, a live successor, a cancelled job and a run out of restarts are not."""
    from rollhpc.launch import requeue, rescue

    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "job_id").write_text("41\n")
    (tmp_path / "slurm" / "batch.sh").write_text("#SBATCH --job-name=rollhpc-rq\n")
    (tmp_path / RunPaths.FAILED_NODES).write_text('{"node2": "rank 3 died"}')
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("ROLLHPC_RESTART_BASE", raising=False)
    requeue.main(["start", str(tmp_path)])
    records = {
        "41": [
            {"JobId": "41", "JobState": "NODE_FAIL", "BatchHost": "node1"},
            {"JobId": "42", "JobState": "COMPLETING", "ExcNodeList": "node9"},
        ]
    }
    submitted = []
    monkeypatch.setattr(rescue, "job_records", lambda job: records.get(job, []))
    live_jobs_of_run = rescue.live_jobs_of_run
    monkeypatch.setattr(rescue, "live_jobs_of_run", lambda run_dir, name: [])
    monkeypatch.setattr(rescue, "job_alive", lambda job: False)
    monkeypatch.setattr(rescue, "hostnames", lambda expr: {expr})
    monkeypatch.setattr(
        rescue,
        "resubmit",
        lambda run_dir, exclude, n: (submitted.append((exclude, n)), ("43", ""))[1],
    )

    def decide(job: str = "41", max_restarts: int = 5) -> str:
        assert rescue.main([str(tmp_path), job, "--max-restarts", str(max_restarts)]) == 0
        return capsys.readouterr().out.strip()

    assert decide() == rescue.RESCUED and submitted == [({"node2", "node9"}, 1)]
    event = read_events(tmp_path)[-1]
    assert (
        event["by"] == "rescue"
        and event["new_job_id"] == "43"
        and "ended NODE_FAIL" in event["reason"]
    )
    # resubmit wrote it; 43 lives: nothing more to do
    (tmp_path / "slurm" / "job_id").write_text("43\n")
    monkeypatch.setattr(rescue, "job_alive", lambda job: job == "43")
    assert decide() == rescue.NOTHING and len(submitted) == 1
    # 43 never started (its launch failed): its batch host is excluded too
    monkeypatch.setattr(rescue, "job_alive", lambda job: False)
    records["43"] = [{"JobId": "43", "JobState": "FAILED", "BatchHost": "node3"}]
    assert decide("43") == rescue.RESCUED and submitted[-1] == ({"node2", "node3"}, 2)
    assert "before it started the run" in read_events(tmp_path)[-1]["reason"]
    # an older job of the run whose components end one by one (one COMPLETED, one still COMPLETING on the lost
    # node) is no live job of the run: squeue names it, its records say it ended
    monkeypatch.setattr(rescue, "live_jobs_of_run", live_jobs_of_run)
    monkeypatch.setattr(
        rescue.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "40+1\n", "")
    )
    mine = f"{tmp_path.resolve()}/slurm/job-40.out"
    records["40"] = [
        {"JobId": "40", "JobState": "COMPLETED", "StdOut": mine},
        {"JobId": "47", "JobState": "COMPLETING", "StdOut": mine},
    ]
    assert rescue.live_jobs_of_run(tmp_path, "rollhpc-rq") == []
    records["40"][1]["JobState"] = "RUNNING"
    assert rescue.live_jobs_of_run(tmp_path, "rollhpc-rq") == ["40"]
    monkeypatch.setattr(rescue, "live_jobs_of_run", lambda run_dir, name: [])
    # requeued in place and running: not for us
    records["44"] = [{"JobId": "44", "JobState": "RUNNING"}]
    assert decide("44") == rescue.NOTHING
    records["45"] = [{"JobId": "45", "JobState": "CANCELLED"}]  # a person's scancel stays
    assert decide("45") == rescue.ENDED and read_events(tmp_path)[-1]["final"]
    assert decide("41") == rescue.NOTHING, "a run ended on purpose is not undone"
    requeue.main(["start", str(tmp_path)])  # a new attempt (slurm/resume.sh) reopens the run
    assert (
        decide("41", max_restarts=2) == rescue.ENDED
        and "giving up" in read_events(tmp_path)[-1]["reason"]
    )
    assert len(submitted) == 2


def test_a_guard_that_finds_another_ranks_record_still_leaves_error_json(tmp_path):
    """Two guards fire together: the second finds the first's startup-failed.json and kills its own rank at once;
    the launcher then ends the first rank, whose guard dies with it, perhaps before it wrote error.json (seen in
    the suite as "the MPI world ended ... before the controller reported how"). The second writes it then."""
    records.record_startup_failure(
        tmp_path, "node3", "MPI_Init did not finish within 5 s (pid 7)", culprit=True
    )
    (tmp_path / "error.json").unlink()  # the first guard died between its two files
    records.record_startup_failure(
        tmp_path, "node2", "MPI_Init did not finish within 5 s (pid 8)", culprit=True
    )
    err = json.loads((tmp_path / "error.json").read_text())
    assert (
        err["summary"] == "MPI_Init did not finish within 5 s (pid 7)"
        and err["type"] == "WorldNotFormed"
    )
    assert records.startup_failure(tmp_path)["host"] == "node3"  # the first record is kept


def test_a_world_that_never_formed_is_requeued_without_excluding_nodes(tmp_path, monkeypatch):
    from rollhpc.launch import requeue

    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")
    for _ in range(5):  # five restarts after failures so far
        records.log_event(tmp_path, {"event": "requeue", "cause": "failure", "reason": "lost"})
    records.record_startup_failure(
        tmp_path, "node3", "MPI_Init did not finish within 5 s (pid 7 on node3)"
    )
    assert json.loads((tmp_path / "error.json").read_text())["type"] == "WorldNotFormed"
    assert records.startup_failure(tmp_path)["host"] == "node3"
    # srun's 137 (the guard's SIGKILL) with no word from the controller: a restart, counted like a lost worker
    assert (
        requeue.main(["after", str(tmp_path), "137", "--max-restarts", "5"])
        == requeue.EXIT_WORKER_LOST
    )
    (end,) = [e for e in read_events(tmp_path) if e["event"] == "end"]
    assert "MPI world did not form" in end["reason"] and "giving up" in end["reason"]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "6")  # the record belongs to the attempt before
    assert records.startup_failure(tmp_path) is None
    # and this attempt's world formed: srun's status stands
    (tmp_path / "world.json").write_text("[]")
    assert requeue.main(["after", str(tmp_path), "137"]) == 137
    records.record_controller_exit(tmp_path, 0)
    records.record_startup_failure(tmp_path, "node3", "late")  # the controller's word wins
    assert requeue.main(["after", str(tmp_path), "137"]) == 0
    # the controller itself gave up on a worker that never connected: the world did not form either
    monkeypatch.setenv("SLURM_RESTART_COUNT", "7")
    (tmp_path / "world.json").unlink()
    records.record_startup_failure(
        tmp_path, "node1", "worker ranks [3] did not connect to the controller"
    )
    # the first cause is kept
    records.record_startup_failure(tmp_path, "node2", "a later rank's timeout")
    records.record_controller_exit(tmp_path, requeue.EXIT_WORKER_LOST)
    assert (
        requeue.main(["after", str(tmp_path), "1", "--max-restarts", "5"])
        == requeue.EXIT_WORKER_LOST
    )
    end = [e for e in read_events(tmp_path) if e["event"] == "end"][-1]
    assert "MPI world did not form: worker ranks [3] did not connect" in end["reason"], end
    # the rank stuck in MPI_Init itself replaces the record of a rank that was only waiting for it
    records.record_startup_failure(
        tmp_path, "node4", "MPI_Init did not finish within 5 s", culprit=True
    )
    records.record_startup_failure(tmp_path, "node2", "the MPI world did not form within 5 s")
    assert records.startup_failure(tmp_path)["host"] == "node4"
    # srun failed and no world formed in this attempt (a rank crashed in start-up): a restart is worth it too
    monkeypatch.setenv("SLURM_RESTART_COUNT", "8")
    assert (
        requeue.main(["after", str(tmp_path), "134", "--max-restarts", "5"])
        == requeue.EXIT_WORKER_LOST
    )
    end = [e for e in read_events(tmp_path) if e["event"] == "end"][-1]
    assert (
        "MPI world did not form: srun exited 134 before every rank had joined" in end["reason"]
    ), end
    (tmp_path / "world.json").write_text("[]")  # once the world formed, srun's status stands again
    assert requeue.main(["after", str(tmp_path), "134"]) == 134
    requeue.main(["start", str(tmp_path)])  # each attempt's world is its own
    assert not (tmp_path / "world.json").exists()


def test_a_finished_run_is_never_started_again(tmp_path, monkeypatch, capsys):
    from rollhpc.checkpoint.storage import CheckpointStore
    from rollhpc.launch import requeue

    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    (tmp_path / "config.yaml").write_text("pipeline: {options: {steps: 3}}\n")
    store = CheckpointStore(tmp_path / "checkpoints")
    store.commit(store.begin(2))
    assert requeue.finished_run(tmp_path) is None
    assert requeue.main(["start", str(tmp_path)]) == 0 and capsys.readouterr().out == ""
    # a worker lost after the final checkpoint: nothing is requeued, the job ends 0
    store.commit(store.begin(3))
    assert "its newest checkpoint, step_000003, is its last step (steps=3)" in requeue.finished_run(
        tmp_path
    )
    records.record_controller_exit(tmp_path, requeue.EXIT_WORKER_LOST)
    (tmp_path / "world.json").write_text("[]")
    assert requeue.main(["after", str(tmp_path), "137"]) == 0
    # Slurm requeued it anyway (a node failure): the next attempt says so and starts nothing
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert requeue.main(["start", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert (
        out.out == "finished\n" and "the run has already finished (its newest checkpoint" in out.err
    )
    assert [e["event"] for e in read_events(tmp_path)] == ["start", "end", "end"]
    # a clean controller exit is enough on its own
    (tmp_path / "checkpoints").rename(tmp_path / "moved")
    records.record_controller_exit(tmp_path, 0)
    assert requeue.finished_run(tmp_path).startswith(
        "its controller ended cleanly (job 123, restart 1)"
    )


def test_het_groups_packed_onto_one_node_are_found():
    from rollhpc.launch.slurm_job import shared_nodes

    assert shared_nodes([["node3"], ["node3"]]) == {1: {"node3"}}
    assert shared_nodes([["n1", "n2"], ["n3"], ["n2", "n3", "n4"]]) == {2: {"n2", "n3"}}
    assert shared_nodes([["n1"], ["n2"]]) == {} and shared_nodes([["n1", "n2"]]) == {}


def test_a_restart_is_a_new_job_with_the_lost_nodes_excluded(tmp_path, monkeypatch, capsys):
    """The successor's batch text and environment (the chaos tests below submit real ones), and an old job
    that Slurm requeued as well starting nothing once its successor lives."""
    from rollhpc.launch import requeue, resubmit

    text = "\n".join(
        [
            "#!/bin/bash",
            "#SBATCH --time=1:00:00",
            "# het group 0: controller, reward",
            "#SBATCH --nodes=1",
            "#SBATCH --exclude=n9",
            "#SBATCH hetjob",
            "# het group 1: train",
            "#SBATCH --nodes=2",
            "",
            "srun ...",
        ]
    )
    # hostlists are taken as written without scontrol
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    out = resubmit.with_exclusions(text, {"n2", "n1"}).split("\n")
    assert out[2:9] == [
        "# het group 0: controller, reward",
        "#SBATCH --nodes=1",
        "#SBATCH --exclude=n1,n2,n9",
        "#SBATCH hetjob",
        "# het group 1: train",
        "#SBATCH --nodes=2",
        "#SBATCH --exclude=n1,n2",
    ]
    assert resubmit.with_exclusions(text, set()) == text
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm.conf")
    monkeypatch.setenv("ROLLHPC_ATTEMPT_STARTED", "1.5")
    env = resubmit.successor_env(3)
    assert env["ROLLHPC_RESTART_BASE"] == "3" and env["SLURM_CONF"] == "/etc/slurm.conf"
    assert not {"SLURM_JOB_ID", "SLURM_RESTART_COUNT", "ROLLHPC_ATTEMPT_STARTED"} & set(env)
    monkeypatch.setenv("ROLLHPC_RESTART_BASE", "3")
    # three restarts before this job, one requeue of it by Slurm
    assert requeue.restart_number() == 4
    # job 41 was requeued by Slurm after job 42 took the run over: it starts nothing while 42 lives
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "job_id").write_text("42\n")
    monkeypatch.setattr(requeue, "job_alive", lambda job: job == "42")
    assert requeue.main(["start", str(tmp_path)]) == 0 and capsys.readouterr().out == "superseded\n"
    assert (
        read_events(tmp_path)[-1]["reason"] == "job 42 continues the run already: nothing to start"
    )
    # 42 has ended: 41 takes the run (back) over
    monkeypatch.setattr(requeue, "job_alive", lambda job: False)
    assert requeue.main(["start", str(tmp_path)]) == 0 and capsys.readouterr().out == ""
    assert (tmp_path / "slurm" / "job_id").read_text() == "41\n" and read_events(tmp_path)[-1][
        "restart"
    ] == 4


def start_standin_srun() -> subprocess.Popen:
    """A process standing in for a srun that never ends by itself (the watcher's logic, without Slurm; the
    chaos tests below run the real thing)."""
    return subprocess.Popen(["/bin/sleep", "600"])


def test_watcher_ends_a_step_that_outlives_its_controller(tmp_path, monkeypatch):
    from rollhpc.launch import requeue

    for var in ("SLURM_JOB_ID", "SLURM_HET_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    srun = start_standin_srun()
    records.record_controller_exit(tmp_path, requeue.EXIT_WORKER_LOST)
    t0 = time.monotonic()
    assert requeue.cmd_watch(tmp_path, srun.pid, grace_s=0.5, poll_s=0.05) == 0
    assert srun.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - t0 < 5
    (ended,) = read_events(tmp_path)
    assert (
        ended["event"] == "step-ended" and "the controller ended with status 76" in ended["reason"]
    )
    # the controller's process gone without a word (it ran on this host, as rank 0 runs on the batch host)
    (tmp_path / RunPaths.CONTROLLER_EXIT).unlink()
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setenv("SLURMD_NODENAME", "nodeX")
    (tmp_path / RunPaths.WORLD).write_text(
        json.dumps([{"rank": 0, "host": "nodeX", "pid": gone.pid}])
    )
    srun = start_standin_srun()
    requeue.cmd_watch(tmp_path, srun.pid, grace_s=0.1, poll_s=0.05)
    assert srun.wait(timeout=5) == -signal.SIGKILL
    assert (
        f"the controller (pid {gone.pid}) is gone without a word"
        in read_events(tmp_path)[-1]["reason"]
    )


def test_watcher_ends_a_step_whose_world_never_forms(tmp_path, monkeypatch):
    """No rank ever ran (srun stuck before launching them), so no guard can speak: the batch script's watcher
    records a start-up failure at its own limit, which `after` requeues like any world that did not form."""
    from rollhpc.launch import requeue

    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    # no squeue/scancel here: srun itself is killed
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    srun = start_standin_srun()
    requeue.cmd_watch(tmp_path, srun.pid, grace_s=1, world_timeout_s=0.5, poll_s=0.05)
    assert srun.wait(timeout=5) == -signal.SIGKILL
    assert (
        "no MPI world formed within 0.5 s of srun's start"
        in records.startup_failure(tmp_path)["why"]
    )


@pytest.fixture(scope="module")
def uninterrupted_run(tiny_model, tmp_path_factory) -> Path:
    """The reference run; it also ends by exporting its model (export_hf=final: RUN_DIR/export/hf), which decides
    nothing about its weights, so the runs compared with it leave that out. Made at umask 022, a shared
    cluster's usual one (the quickstart test runs at 027)."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    res = rollhpc(
        "train",
        "quickstart",
        *run_args(tiny_model),
        "pipeline.options.export_hf=final",
        cwd=cwd,
        timeout=600,
        preexec_fn=lambda: os.umask(0o022),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return cwd / "runs" / "quickstart"


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> list[dict]:
    metrics = read_metrics(uninterrupted_run / "metrics.jsonl")
    assert metrics[-1]["step"] == STEPS and len(metrics[-1]["weights_sha256"]) == 64
    scales = [scale for _, scale in trajectory(metrics).values()]
    assert len(set(scales)) == STEPS, (
        "the KL coefficient moves every step (its state is worth restoring)"
    )
    assert all(m["sample_version_lag"] > 0 for m in metrics[2:]), (
        "batches after the first were generated ahead"
    )
    return metrics


def hf_weights_digest(model_dir: Path) -> str:
    """The trainer's ``weights_digest`` recomputed from safetensors files (same names, dtypes, bytes)."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


VLLM_GREEDY = """
import json, sys
from rollhpc.engines.vllm_engine import VllmGenerator
if __name__ == "__main__":
    engine = VllmGenerator(sys.argv[1], max_model_len=64, dtype="float32")
    prompts = json.loads(sys.argv[2])
    out = engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=6, ignore_eos=True)
    print("RESULT " + json.dumps([c[0].token_ids for c in out]))
"""


@pytest.mark.slow
def test_a_run_exports_to_hf_and_vllm_generates_from_it(tmp_path, uninterrupted_run, uninterrupted):
    """Issues 6 and 34: `rollhpc export RUN_DIR OUT_DIR` turns the trainer's part of the run's newest good
    checkpoint (a Megatron dist checkpoint) into a Hugging Face directory holding exactly the run's final weights,
    with its tokenizer and generation config; transformers and vLLM load it and agree on greedy continuations. The
    run itself, with export_hf=final, wrote the same directory to RUN_DIR/export/hf when it finished; `--step N`
    exports an earlier checkpoint, and `rollhpc convert` takes a step directory."""
    import stat

    import torch
    import transformers

    # made at umask 022: everything the run wrote (logs, metrics, checkpoints and their manifests, `latest`, the
    # export) is readable by every user, every folder enterable: a colleague can read the run and its model
    modes = {
        str(p.relative_to(uninterrupted_run)): stat.S_IMODE(p.lstat().st_mode)
        for p in [uninterrupted_run, *uninterrupted_run.rglob("*")]
        if not p.is_symlink()
    }
    assert {
        "export/hf/model.safetensors",
        "checkpoints/latest",
        "metrics.jsonl",
        "logs/rank1-train.log",
    } <= set(modes)
    assert {
        k: oct(m)
        for k, m in modes.items()
        if m != (0o755 if (uninterrupted_run / k).is_dir() else 0o644)
    } == {}

    final = uninterrupted[-1]["weights_sha256"]
    checkpoints = uninterrupted_run / "checkpoints"
    hf = tmp_path / "hf"
    res = rollhpc(
        "export",
        str(uninterrupted_run),
        str(hf),
        "--verify",
        "--no-progress",
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    src = checkpoints / f"step_{STEPS:06d}" / "train" / "model"
    assert (
        f"rollhpc export: reading {src} (the run's newest good checkpoint, step_{STEPS:06d})"
        in res.stderr
    )
    assert re.search(
        rf"rollhpc export: wrote {re.escape(str(hf.resolve()))}: 1 safetensors file\(s\), [0-9.]+ MiB, "
        r"and config.json, generation_config.json, .*tokenizer.json.*; verify: .* \(ok, ",
        res.stderr,
    ), res.stderr
    assert hf_weights_digest(hf) == final

    # export_hf=final: the run ended by writing the same directory, file for file
    exported = uninterrupted_run / "export" / "hf"
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == {
        p.name: p.read_bytes() for p in hf.iterdir()
    }
    log = (uninterrupted_run / "logs" / "rank0-controller.log").read_text()
    assert (
        f"export_hf=final: wrote {exported}, a Hugging Face directory of the trainer's model of "
        f"step_{STEPS:06d}" in log
    )

    # --step: an earlier checkpoint (checkpoint.every=2, keep_last=2: steps 6 and 8 are kept), or a clear refusal
    earlier = rollhpc(
        "export",
        str(uninterrupted_run),
        str(tmp_path / "step6"),
        "--step",
        str(STEPS - 2),
        "--no-progress",
        cwd=tmp_path,
        timeout=300,
    )
    assert (
        earlier.returncode == 0
        and f"(the checkpoint --step {STEPS - 2} asks for, step_{STEPS - 2:06d})" in earlier.stderr
    ), earlier.stderr[-3000:]
    assert hf_weights_digest(tmp_path / "step6") != final
    missing = rollhpc(
        "export", str(uninterrupted_run), str(tmp_path / "x"), "--step", "3", cwd=tmp_path
    )
    assert missing.returncode == 2 and missing.stderr.strip() == (
        f"rollhpc export: {uninterrupted_run}: no good checkpoint of step 3; steps there: {STEPS - 2}, {STEPS}"
    )
    step = rollhpc(
        "convert", "mcore-to-hf", str(src.parents[1]), str(tmp_path / "x"), "--check", cwd=tmp_path
    )
    assert (
        step.returncode == 0
        and f"reading {src} (the train role's model of checkpoint" in step.stderr
    ), step.stderr
    assert not (tmp_path / "x").exists()

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    prompts = [tokenizer.encode(text) for text in ("12+34=", "7+58=", "99+1=")]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )
        expected.append(out[0, len(p) :].tolist())
    gen = subprocess.run(
        [sys.executable, "-c", VLLM_GREEDY, str(hf), json.dumps(prompts)],
        env=cli_env(),
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    (line,) = [x for x in gen.stdout.splitlines() if x.startswith("RESULT ")]
    assert json.loads(line[len("RESULT ") :]) == expected


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trainer_lost_in_the_gradient_all_reduce_is_a_lost_worker(tmp_path, tiny_model):
    """A collective of the trainer's own: two data-parallel trainer ranks, the last held by a test hook before the
    gradient all-reduce of its 3rd train call while the other waits inside it, then SIGKILLed. Whichever reaches
    the controller first, the survivor's gloo error or the death, the verdict is a lost worker (restartable,
    exit 76 for the batch script, its node to exclude), not an error of the run's own. The restart itself is
    the chaos test's below; tests/unit/test_failure.py has the rules."""
    from rollhpc.testing.fault_injection import HOLD_IN_GRAD_SYNC

    run_dir = tmp_path / "runs" / "quickstart"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollhpc.cli",
            "train",
            "quickstart",
            *run_args(tiny_model),
            "pipeline.options.steps=4",
            "roles.train.procs=2",
        ],
        cwd=tmp_path,
        env={**cli_env(), HOLD_IN_GRAD_SYNC: "3:120"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    held = wait_for(
        "the held all-reduce",
        lambda: (
            (run_dir / "logs").is_dir()
            and next(
                (
                    p
                    for p in (run_dir / "logs").glob("rank*-train.log")
                    if "holding the gradient all-reduce of train call 3 "
                    in p.read_text(errors="replace")
                ),
                None,
            )
        ),
        240,
        proc,
    )
    rank = int(held.name.split("-")[0].removeprefix("rank"))
    os.kill(json.loads((run_dir / "world.json").read_text())[rank]["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    verdict = json.loads((run_dir / "controller-exit.json").read_text())
    assert verdict["status"] == 76 and verdict["failure"]["kind"] == "lost_worker", verdict
    assert f"worker rank {rank} (role 'train', group rank 1" in verdict["failure"]["summary"], (
        verdict
    )
    assert "died while running 'train_step'" in verdict["failure"]["summary"], verdict
    assert_no_orphans(run_dir)


@pytest.fixture
def small_filesystem(tmp_path):
    """A tmpfs of its own (256 MiB) for a run's output, unmounted afterwards; skipped where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_run_resumes_exactly_past_a_damaged_checkpoint_and_a_full_disk(
    small_filesystem, tmp_path, tiny_model, uninterrupted
):
    """The run (async: its checkpoints hold the batch generated ahead), its output on a filesystem of its own, is
    SIGKILLed as a whole local world after step 7; the newest checkpoint (step 6) is then damaged (a truncated
    optimizer shard): --resume must notice and fall back to step 4. Meanwhile the filesystem has filled (as a
    quota does) to less than a checkpoint's size: that session's checkpoint 6 is not started, and the run ends
    with one line that names the filesystem, its free space, what a checkpoint takes, the newest good checkpoint
    and the command that continues; error.json, the verdict and `rollhpc status` say the same, and that checkpoint
    verifies deep. Once space is freed a second --resume finishes, bit-identical to the run left alone."""
    out = small_filesystem / "runs"
    run_dir = out / "quickstart"
    args = ["train", "quickstart", *run_args(tiny_model), f"run.output_dir={out}"]
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollhpc.cli", *args],
            cwd=tmp_path,
            env=cli_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for("step 7", lambda: last_step(run_dir) >= 7, 300, proc, log)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert_no_orphans(run_dir)
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["step"] == 7
    shard = max(
        (run_dir / "checkpoints" / "step_000006" / "train" / "optimizer").glob("*.distcp"),
        key=lambda p: p.stat().st_size,
    )
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    verify = rollhpc("ckpt", "verify", str(run_dir), cwd=tmp_path)
    assert verify.returncode == 1 and "step_000006" in verify.stdout + verify.stderr

    # the filesystem fills to half a checkpoint's room
    size = sum(p.stat().st_size for p in (run_dir / "checkpoints" / "step_000004").rglob("*"))
    filler = small_filesystem / "filler"
    with open(filler, "wb") as fill:
        os.posix_fallocate(fill.fileno(), 0, shutil.disk_usage(small_filesystem).free - size // 2)
    res = rollhpc(args[0], "--resume", *args[1:], cwd=tmp_path, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "step_000006" in res.stderr  # the damaged checkpoint, skipped
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "rollhpc: run failed: out of disk space: checkpoint 6 was not started, it would not fit: "
        f"{small_filesystem} has"
    ), last
    assert "the newest good checkpoint, step_000004 (step 4), is intact" in last, last
    assert f"slurm/resume.sh {run_dir}" in last and "--resume" in last, last
    err = json.loads((run_dir / "error.json").read_text())
    assert err["type"] == "OutOfSpace" and err["summary"] in last
    verdict = json.loads((run_dir / "controller-exit.json").read_text())
    assert verdict["status"] == 1 and verdict["failure"]["kind"] == "disk_full", verdict
    status = rollhpc("status", str(run_dir), cwd=tmp_path)
    assert "out of disk space: checkpoint 6 was not started" in status.stdout, status.stdout
    deep = rollhpc(
        "ckpt", "verify", "--deep", str(run_dir / "checkpoints" / "step_000004"), cwd=tmp_path
    )
    assert deep.returncode == 0, deep.stdout + deep.stderr

    filler.unlink()
    res = rollhpc(args[0], "--resume", *args[1:], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    resumes = [e for e in read_events(run_dir) if e["event"] == "resume"]
    # both from step 4, saved before any restart: each the run's first restart from there
    assert [(e["step"], e["restarts"]) for e in resumes] == [(4, 1), (4, 1)]
    metrics = assert_same_as_uninterrupted(run_dir, uninterrupted)
    assert metrics[5]["restarts"] == 1
    assert_no_orphans(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_routing_replay_r3_resumes_exactly_with_samples_in_flight(tmp_path):
    """An async run (the next batch generated while the trainer works) on a tiny MoE policy whose expert-parallel
    trainer (EP=2) replays the generator's routes (router_replay: r3): the torch engine returns the experts of
    every token it fed, they travel with the samples into the batch and the rollouts file, and the trainer
    replays them. Asked to stop after step 2 it checkpoints with that batch in hand, its samples carrying their
    routes, and --resume ends bit-identical to the same run left alone (losses of every step, final weights).
    ``async_run`` alone: no reference role, five steps."""
    from rollhpc.tasks import arithmetic
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model

    train, _ = arithmetic.make_splits(0, 300, 0, digits=2, ops=("+",))
    model = create_tiny_model(
        tmp_path / "tiny_moe",
        TinyModelConfig(moe=True, tie_word_embeddings=False),
        build_tokenizer(list(arithmetic.corpus(train)), 300),
    )
    steps = 5
    args = [
        "train",
        "quickstart",
        *async_run(model, steps),
        "roles.train.options.router_replay=r3",
        "roles.train.procs=2",
        "roles.train.parallel.ep=2",
    ]
    (tmp_path / "alone").mkdir()
    alone = rollhpc(*args, cwd=tmp_path / "alone", timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    reference = read_metrics(tmp_path / "alone" / "runs" / "quickstart" / "metrics.jsonl")
    assert all("train/route_replay_differ_frac" in m for m in reference[1:])
    # step 1 trains on the weights that generated its batch (float32 both): the generator's experts are the ones
    # the trainer's own router takes, every one of them
    assert reference[1]["train/route_replay_differ_frac"] == 0.0, reference[1]
    # the rollouts keep them: each sample's prompt and response but its last token, 2 layers x top 2
    from rollhpc.observability.rollouts import read_rollouts

    got = read_rollouts(tmp_path / "alone" / "runs" / "quickstart" / "rollouts" / "step_000001.h5")
    assert [r.shape for r in got["routes"]] == [
        (len(p) + len(t) - 1, 2, 2) for p, t in zip(got["prompt_tokens"], got["response_tokens"])
    ]

    run_dir = tmp_path / "runs" / "quickstart"
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollhpc.cli", *args],
            cwd=tmp_path,
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        wait_for("step 2", lambda: last_step(run_dir) >= 2, 300, proc, log)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=300) == EXIT_REQUEUE, log.read_text()[-3000:]
    assert last_step(run_dir) < steps
    res = rollhpc(args[0], "--resume", *args[1:], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps + 1))
    losses = {m["step"]: m["train/loss"] for m in metrics if "train/loss" in m}
    assert losses == {m["step"]: m["train/loss"] for m in reference if "train/loss" in m}
    assert metrics[-1]["weights_sha256"] == reference[-1]["weights_sha256"]
    assert_no_orphans(run_dir)


# -- on the real local Slurm cluster --------------------------------------------------------------------


def submit(
    slurm_cluster, tmp_path: Path, model: Path, *extra: str, env: dict[str, str] | None = None
) -> str:
    """`rollhpc submit quickstart` with the train rank alone in a het group of its own (a fake GPU), so it
    runs on another node than the controller: a node of the job can die without the batch script."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollhpc.cli",
            "submit",
            "quickstart",
            *run_args(model),
            "run.name=rq",
            f"run.output_dir={tmp_path / 'runs'}",
            "roles.train.gpus_per_proc=1",
            f"cluster.nodes={slurm_cluster.nodes}",
            f"cluster.cpus_per_node={slurm_cluster.cpus_per_node}",
            f"cluster.gpus_per_node={slurm_cluster.gpus_per_node}",
            *extra,
        ],
        cwd=tmp_path,
        env={**slurm_cluster.env, **(env or {})},
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return (tmp_path / "runs" / "rq" / "slurm" / "job_id").read_text().strip()


def run_story(run_dir: Path) -> str:
    """What a Slurm run did, for a failure message: its restarts.jsonl events, then every job's output."""
    return (
        "restarts.jsonl:\n" + "\n".join(map(str, read_events(run_dir))) + "\n" + job_output(run_dir)
    )


def job_output(run_dir: Path, tail: int | None = 4000) -> str:
    """The output of every job of the run (a restart is a new job, with a file of its own)."""
    return "\n".join(
        p.read_text(errors="replace")[-(tail or 0) :]
        for p in sorted((run_dir / "slurm").glob("job-*.out"))
    )


def wait_job_done(slurm_cluster, job_id: str, run_dir: Path, timeout: float) -> str:
    """The state of the run's last job once it has ended for good: a restart continues the run in a new job
    (RUN_DIR/slurm/job_id names it), submitted by the batch script or by the ended job's rescue job."""
    deadline = time.monotonic() + timeout
    while True:
        current = (run_dir / "slurm" / "job_id").read_text().strip()
        records = slurm_cluster.job_records(current)
        # a job that ended on its own: its rescue decides what follows
        rescue = rescue_jobs(run_dir).get(current)
        rescuing = rescue and any(
            r.get("JobState") not in TERMINAL for r in slurm_cluster.job_records(rescue)
        )
        if (
            records
            and all(r.get("JobState") in TERMINAL for r in records)
            and not rescuing
            and (run_dir / "slurm" / "job_id").read_text().strip() == current
        ):
            return records[0]["JobState"]
        if time.monotonic() > deadline:
            slurm_cluster.run(["scancel", current], check=False)
            raise AssertionError(
                f"job {current} (the run's first: {job_id}) not finished after {timeout} s: "
                f"{[(r.get('JobId'), r.get('JobState'), r.get('Reason')) for r in records]}\n"
                + run_story(run_dir)
            )
        time.sleep(0.3)


def starts(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "start"]


def train_host(run_dir: Path) -> str:
    world = json.loads((run_dir / "world.json").read_text())
    (host,) = {w["host"] for w in world if w["role"] == "train"}
    return host


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_time_limit_warning_checkpoints_requeues_and_finishes(
    slurm_cluster, tmp_path, tiny_model, uninterrupted
):
    """Acceptance (2): Slurm's own time-limit warning (--signal=B:USR1@N, N=120 s before a 3 min limit)
    reaches the batch shell, the controller checkpoints after its current step and leaves with 75, the batch
    script continues the run in a new job, and the next start resumes. The test hook holds checkpoint 6 of
    the first attempt until the warning has come, so the warning always finds the run mid-way. In the continued
    job the trainer's node dies inside the first weight sync (another hook holds it there): with
    max_restarts=1 the continuation did not use the one restart up, so the run restarts once more and
    finishes."""
    run_dir = tmp_path / "runs" / "rq"
    job_id = submit(
        slurm_cluster,
        tmp_path,
        tiny_model,
        "cluster.time_limit=00:03:00",
        "cluster.stop_before_limit_s=120",
        "cluster.max_restarts=1",
        env={DELAY_ENV: "6:170", HOLD_IN_WEIGHT_SYNC: "1:120:1"},
    )

    def requeues(n: int) -> list[dict]:
        """The run's first n requeue events, once there are n; each new job given room (the warning would
        otherwise come again a minute after its start)."""
        found = wait_for(
            f"requeue {n}",
            lambda: [e for e in read_events(run_dir) if e["event"] == "requeue"][n - 1 :],
            300,
            run_dir=run_dir,
        )
        for comp in [r["JobId"] for r in slurm_cluster.job_records(found[0]["new_job_id"])]:
            slurm_cluster.run(
                ["scontrol", "update", f"JobId={comp}", "TimeLimit=00:10:00"], check=False
            )
        return [e for e in read_events(run_dir) if e["event"] == "requeue"][:n]

    requeued = requeues(1)
    assert requeued[0]["new_job_id"] != job_id, requeued
    wait_for(
        "the continued job's first weight sync, held",
        lambda: holding(run_dir, "holding the weight sync 1 "),
        300,
        run_dir=run_dir,
    )
    lost = train_host(run_dir)
    try:
        node(slurm_cluster, "node-crash", lost)
        time.sleep(8)  # past SlurmdTimeout (5 s)
    finally:
        node(slurm_cluster, "node-start", lost)
    requeued = requeues(2)
    state = wait_job_done(slurm_cluster, job_id, run_dir, timeout=400)
    assert state == "COMPLETED", f"{state}\n{run_story(run_dir)}"
    assert requeued[0]["reason"].startswith("checkpoint saved at the time-limit warning"), requeued
    assert [e["cause"] for e in requeued] == ["continuation", "failure"], requeued
    assert re.search(
        r"stopping after step \d+ for a requeue \(stop-request: time-limit warning",
        job_output(run_dir, None),
    )
    events = read_events(run_dir)
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes and resumes[0]["step"] >= 1, events
    assert [e["restart"] for e in starts(run_dir)] == list(range(len(resumes) + 1))
    assert_same_as_uninterrupted(run_dir, uninterrupted)

    # a new job for the finished run: a changed setting is refused before anything reaches Slurm; with
    # only the machines changed, it starts, finds the last step's checkpoint and has nothing left to do
    resume = [str(REPO / "slurm" / "resume.sh"), str(run_dir)]
    env = {**slurm_cluster.env, "ROLLHPC_VENV": str(Path(sys.executable).parents[1])}
    refused = subprocess.run(
        [*resume, "pipeline.options.steps=10"], env=env, text=True, capture_output=True, timeout=120
    )
    assert (
        refused.returncode == 2
        and "differs from the run's" in refused.stderr
        and "pipeline.options.steps" in refused.stderr
    )
    attempts = len(starts(run_dir))
    again = subprocess.run(
        [*resume, "cluster.time_limit=00:05:00", "--wait"],
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr + job_output(run_dir)
    assert "the run has already finished (its controller ended cleanly" in job_output(run_dir, None)
    assert len(starts(run_dir)) == attempts, "no world was started for a finished run"
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["step"] == STEPS


# -- chaos: nodes lost at awkward moments (issue 13) ------------------------------------------------------


def node(slurm_cluster, action: str, name: str) -> None:
    """`slurm/local-cluster.sh node-crash|node-start DIR NAME`."""
    res = subprocess.run(
        ["bash", str(REPO / "slurm" / "local-cluster.sh"), action, str(slurm_cluster.dir), name],
        env=slurm_cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


def task_processes(run_dir: Path) -> list:
    """The processes of this run's Slurm tasks: `python -m rollhpc.rank RUN_DIR` (srun's own command line
    names it too, and is left out)."""
    return [
        p
        for p in rank_processes(run_dir)
        if (cmd := p.info["cmdline"] or [])
        and "rollhpc.rank" in cmd
        and not cmd[0].endswith("srun")
    ]


def committed(run_dir: Path, step: int) -> bool:
    from rollhpc.checkpoint.storage import CheckpointStore

    return CheckpointStore(run_dir / "checkpoints").latest_step() == step


def holding(run_dir: Path, what: str) -> bool:
    """Whether a rank's log says a test hook holds it (rollhpc.testing.fault_injection): ``what`` as the hook words it."""
    return any(what in p.read_text(errors="replace") for p in (run_dir / "logs").glob("rank*.log"))


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_node_lost_in_sync_batch_node_meanwhile_then_while_forming(
    slurm_cluster, tmp_path, tiny_model, uninterrupted
):
    """Three node crashes in one run, with nobody waiting on a login node and no person acting.
    1. The trainer's node dies inside the 5th weight sync (the sender held half-way by a test hook, the
       generator blocked in the broadcast): whether the generator's gloo error reaches the controller before the
       trainer's death does (before: "run failed ... raised RuntimeError in 'receive_weights'", exit 1, no
       restart) or after, the verdict is the trainer's loss.
    2. 0.3 s later, while that failure is being handled, the batch node dies too (controller, generator, reward
       worker and the batch script). Both are back 8 s later. The batch script cannot continue the run; the job
       is never requeued by Slurm, so never held: it ends NODE_FAIL and its rescue job continues the run.
    3. While the rescued attempt's world forms (its ranks started, world.json not yet written), its trainer's
       node dies and is back 15 s later: Slurm ends that job too (or, had the node come back before Slurm
       noticed, the ranks' guards give up at controller.world_timeout_s and the batch script ends the step
       srun would wait on forever), and the run continues in a third attempt.
    The run ends COMPLETED, every step logged once, with the uninterrupted run's weights."""
    from rollhpc.testing.fault_injection import HOLD_IN_WEIGHT_SYNC

    run_dir = tmp_path / "runs" / "rq"
    # a world that lost a rank while forming waits in MPI_Init or the first collectives for the ranks' guards
    job_id = submit(
        slurm_cluster,
        tmp_path,
        tiny_model,
        "controller.world_timeout_s=60",
        env={HOLD_IN_WEIGHT_SYNC: "5:120"},
    )
    wait_for(
        "the 5th weight sync, held",
        lambda: (run_dir / "logs").is_dir() and holding(run_dir, "holding the weight sync 5 "),
        300,
        run_dir=run_dir,
    )
    lost, batch = train_host(run_dir), starts(run_dir)[0]["batch_host"]
    try:
        node(slurm_cluster, "node-crash", lost)
        time.sleep(0.3)
        node(slurm_cluster, "node-crash", batch)
        time.sleep(8)
    finally:
        node(slurm_cluster, "node-start", batch)
        node(slurm_cluster, "node-start", lost)
    second = wait_for(
        "the rescued attempt's start",
        lambda: len(starts(run_dir)) >= 2 and starts(run_dir)[1],
        300,
        run_dir=run_dir,
    )
    forming = [n for n in second["nodes"] if n != second["batch_host"]][0]
    wait_for(
        "the rescued attempt's ranks",
        lambda: len(task_processes(run_dir)) >= 5,
        120,
        run_dir=run_dir,
    )
    world_formed = (run_dir / "world.json").exists()
    try:
        node(slurm_cluster, "node-crash", forming)
        # past SlurmdTimeout (5 s): Slurm ends the job (NODE_FAIL), not the guards a minute later
        time.sleep(15)
    finally:
        node(slurm_cluster, "node-start", forming)
    assert not world_formed, "the third crash was meant to land while the world forms"
    state = wait_job_done(slurm_cluster, job_id, run_dir, timeout=500)
    assert state == "COMPLETED", f"{state}\n{run_story(run_dir)}"
    controller_log = (run_dir / "logs" / "rank0-controller.log").read_text()
    assert "failure classified as lost_worker" in controller_log
    # the trainer's death is seen first (its sideband), or the generator's gloo error is, named as its echo
    assert re.search(r"role 'train'.*died while running 'broadcast_weights'", controller_log), (
        controller_log
    )
    assert not re.search(r"run failed: worker rank \d+ \(role 'generate'", controller_log), (
        controller_log
    )
    events = read_events(run_dir)
    rescued = [e for e in events if e["event"] == "requeue" and e.get("by") == "rescue"]
    assert rescued and "NODE_FAIL" in rescued[0]["reason"] and rescued[0]["job_id"] == job_id, (
        events
    )
    assert not [e for e in events if e["event"] == "release"], "no held job, nothing released"
    attempts = starts(run_dir)
    assert len(attempts) >= 3 and lost not in attempts[1]["nodes"], attempts
    assert [e["restart"] for e in attempts] == list(range(len(attempts)))
    assert_same_as_uninterrupted(run_dir, uninterrupted)
    waiting = {
        r: st
        for r in rescue_jobs(run_dir).values()
        if (st := slurm_cluster.job_state(r)) not in TERMINAL
    }
    assert not waiting, f"rescue jobs left in the queue: {waiting}"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_sigterm_while_forming_then_a_node_lost_after_the_last_step(
    slurm_cluster, tmp_path, tiny_model, uninterrupted
):
    """1. The controller rank is stuck in MPI_Init, deaf to signals (blocked in C, as on a dead PMI socket),
       and Slurm ends the step with SIGTERM (as when another task aborts in start-up). The other ranks die
       of it; the controller's guard survives it and kills the deaf rank 3 s later, long before
       controller.world_timeout_s (300 s); the job is requeued with no node excluded.
    2. In the next attempt the trainer's node dies after the final checkpoint was committed (the controller
       held there by a test hook), and comes back. The run has finished: the job ends COMPLETED and no
       world starts again."""
    run_dir = tmp_path / "runs" / "rq"
    job_id = submit(
        slurm_cluster,
        tmp_path,
        tiny_model,
        "controller.world_timeout_s=300",
        env={STALL_MPI_INIT: "0:deaf", HOLD_AFTER_CHECKPOINT: f"{STEPS}:20"},
    )
    wait_for(
        "the controller rank stalled, deaf",
        lambda: "rank 0 stalls before mpi_init (deaf" in job_output(run_dir),
        120,
    )
    time.sleep(1)  # the other ranks reach MPI_Init
    tasks = task_processes(run_dir)  # every process of every task: ranks and their guards
    # 5 ranks, the deaf one's guard at least
    assert len(tasks) >= 6, [p.info["cmdline"] for p in tasks]
    for (
        p
    ) in tasks:  # SIGTERM to each, as Slurm signals a task (and as srun does when a task aborts)
        p.send_signal(signal.SIGTERM)
    (requeued,) = wait_for(
        "the requeue, well before world_timeout_s",
        lambda: [e for e in read_events(run_dir) if e["event"] == "requeue"],
        60,
    )
    assert "MPI world did not form: the step was ended (SIGTERM) while pid" in requeued["reason"], (
        requeued
    )
    assert requeued["exclude"] == [], requeued
    wait_for("the final checkpoint", lambda: committed(run_dir, STEPS), 400, run_dir=run_dir)
    lost = train_host(run_dir)
    node(slurm_cluster, "node-crash", lost)
    time.sleep(2)
    node(slurm_cluster, "node-start", lost)
    state = wait_job_done(slurm_cluster, job_id, run_dir, timeout=300)
    assert state == "COMPLETED", f"{state}\n{run_story(run_dir)}"
    # the guard's own word
    assert "rollhpc: the step was ended (SIGTERM) while pid" in job_output(run_dir, None)
    events = read_events(run_dir)
    assert len(starts(run_dir)) == 2 and [e["event"] for e in events].count("resume") == 0, events
    assert events[-1]["event"] == "end" and events[-1]["status"] == 0, events
    assert_same_as_uninterrupted(run_dir, uninterrupted)
