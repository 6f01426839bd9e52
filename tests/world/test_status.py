"""`rollhpc status` and the held-job watch of `rollhpc submit --wait`: the report's verdict and advice from
hand-made run directories and scontrol records, then one held job on the real local Slurm cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollhpc import cli
from rollhpc.checkpoint.storage import CheckpointStore
from rollhpc.launch import slurm, slurm_cli, status
from rollhpc.rundir.records import read_events
from tests.support.processes import cli_env

JOB = "4242"
# `scontrol show job -o` lines as Slurm writes them (fields trimmed), one per het component
HELD = (
    f"JobId={JOB} HetJobId={JOB} HetJobOffset=0 JobName=rollhpc-rq JobState=PENDING "
    "Reason=launch_failed_requeued_held Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 "
    "NodeList=(null) ExcNodeList=node2 BatchHost=node1 Comment=two words\n"
    f"JobId=4243 HetJobId={JOB} HetJobOffset=1 JobName=rollhpc-rq JobState=PENDING "
    "Reason=launch_failed_requeued_held Restarts=1 NodeList= ExcNodeList=node2\n"
)
RUNNING = (
    f"JobId={JOB} HetJobId={JOB} HetJobOffset=0 JobState=RUNNING Reason=None Restarts=0 "
    "NodeList=node1 BatchHost=node1\n"
    f"JobId=4243 HetJobId={JOB} HetJobOffset=1 JobState=RUNNING Reason=None Restarts=0 NodeList=node[2-3]\n"
)


def run_dir_with(
    tmp_path: Path,
    steps: int = 10,
    last_step: int = 4,
    events: list[dict] | None = None,
    error: str | None = None,
    checkpoint_at: int | None = 4,
) -> Path:
    """A run directory as a Slurm run leaves it: config.yaml, metrics, restarts, a checkpoint, the job id."""
    run = tmp_path / "runs" / "rq"
    (run / "slurm").mkdir(parents=True)
    (run / "config.yaml").write_text(
        yaml.safe_dump({"run": {"name": "rq"}, "pipeline": {"options": {"steps": steps}}})
    )
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": 0.1}) + "\n" for s in range(1, last_step + 1))
    )
    (run / "restarts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events or []))
    (run / "slurm" / "job_id").write_text(JOB + "\n")
    (run / "slurm" / f"job-{JOB}.out").write_text("srun: error: ...\n")
    if error:
        (run / "error.json").write_text(json.dumps({"summary": error, "type": "RuntimeError"}))
    if checkpoint_at is not None:
        store = CheckpointStore(run / "checkpoints")
        pending = store.begin(checkpoint_at)
        (pending.path / "state.bin").write_bytes(b"x" * 10)
        store.commit(pending)
    return run


def report_for(
    run: Path, scontrol_text: str | None = None, sacct: dict[str, str] | None = None
) -> dict:
    if scontrol_text is not None:
        view = status.SlurmView(
            True, "scontrol", status.components_of(slurm_cli.parse_job_records(scontrol_text))
        )
    else:
        view = status.SlurmView(
            True, "sacct", [{"JobId": k, "JobState": v} for k, v in (sacct or {}).items()]
        )
    report = status.build_report(run, JOB, view)
    json.dumps(report)  # --json prints it as it is
    return report


START = {
    "time": "2026-01-01T10:00:00+0000",
    "event": "start",
    "job_id": JOB,
    "slurm_restart_count": 0,
    "nodes": ["node1", "node2"],
    "previous_attempt": None,
}
REQUEUE = {
    "time": "2026-01-01T10:05:00+0000",
    "event": "requeue",
    "job_id": JOB,
    "reason": "worker lost on node2",
    "exclude": ["node2"],
    "slurm_restart_count": 0,
}
GAVE_UP = {
    "time": "2026-01-01T10:09:00+0000",
    "event": "end",
    "status": 76,
    "reason": "a worker was lost and the job already restarted 5 times (max_restarts=5): giving up",
}


def test_scontrol_lines_parse_into_fields_and_holds_are_recognised():
    held, other = slurm_cli.parse_job_records(HELD)
    assert held["Reason"] == "launch_failed_requeued_held" and held["Comment"] == "two words"
    assert held["ExcNodeList"] == "node2" and other["JobId"] == "4243"
    assert slurm_cli.held_reason(held) == "launch failed requeued held"
    assert slurm_cli.restart_count([held, other]) == 1
    assert slurm_cli.held_reason({"JobState": "PENDING", "Reason": "JobHeldUser"}) == "JobHeldUser"
    assert (
        slurm_cli.held_reason({"JobState": "PENDING", "Reason": "JobHeldAdmin"}) == "JobHeldAdmin"
    )
    assert slurm_cli.held_reason({"JobState": "PENDING", "Reason": "Resources"}) is None
    assert slurm_cli.held_reason({"JobState": "RUNNING", "Reason": "None"}) is None


def test_held_job_is_told_how_to_release(tmp_path):
    run = run_dir_with(tmp_path, events=[START, REQUEUE])
    report = report_for(run, HELD)
    assert report["state"] == "held"
    assert report["advice"][0] == (
        f"job {JOB} is held by Slurm (launch failed requeued held): release it with: "
        f"scontrol release {JOB}"
    )
    assert "cluster.release_held=true" in report["advice"][1]
    text = "\n".join(status.render(report))
    assert f"{JOB}+1  PENDING  reason launch_failed_requeued_held  excluded node2" in text
    assert "step           4 of 10" in text and "checkpoint     step_000004 (step 4" in text
    assert "worker lost on node2 (excluding node2)" in text


def test_failed_job_is_told_to_resume_and_where_the_error_is(tmp_path):
    run = run_dir_with(tmp_path, events=[START], error="worker rank 2 raised RuntimeError")
    report = report_for(run, sacct={f"{JOB}+0": "FAILED", f"{JOB}+1": "CANCELLED"})
    assert report["state"] == "ended"
    advice = "\n".join(report["advice"])
    assert report["advice"][0] == "the job ended CANCELLED, FAILED"
    assert f"why: worker rank 2 raised RuntimeError (details in {run / 'error.json'})" in advice
    assert f"the job's output: {run / 'slurm' / f'job-{JOB}.out'}" in advice
    assert f"continue with: slurm/resume.sh {run}   (from step_000004)" in advice
    assert f"rollhpc submit {run / 'config.yaml'} run.output_dir={run.parent} --resume" in advice


def test_job_out_of_restarts_is_told_to_resume(tmp_path):
    run = run_dir_with(tmp_path, events=[START, REQUEUE, START, GAVE_UP], checkpoint_at=None)
    report = report_for(run, sacct={f"{JOB}+0": "COMPLETED", f"{JOB}+1": "COMPLETED"})
    assert report["state"] == "gave_up"
    assert (
        report["advice"][0].startswith(
            "out of restarts after failures (cluster.max_restarts): a worker was lost"
        )
        and "giving up" in report["advice"][0]
    )
    assert (
        f"continue with: slurm/resume.sh {run}   (from the start (no good checkpoint))"
        in report["advice"]
    )
    assert report["restarts"]["restarts"] == 1 and len(report["restarts"]["last"]) == 4
    assert report["restarts"]["failures"] == 1 and report["restarts"]["continuations"] == 0


def test_finished_run_and_running_job(tmp_path):
    finished = run_dir_with(tmp_path, steps=10, last_step=10, checkpoint_at=10)
    report = report_for(finished, sacct={})  # long gone from Slurm: the run directory tells
    assert report["state"] == "finished" and report["advice"][0].startswith("all 10 steps done")
    running = run_dir_with(tmp_path / "b", events=[START])
    report = report_for(running, RUNNING)
    assert report["state"] == "running" and report["advice"][0].startswith("nothing to do")
    assert f"  {JOB}+1  RUNNING  nodes node[2-3]  Slurm restarts 0" in status.render(report)


def test_off_slurm_the_run_directory_is_still_reported(tmp_path):
    run = run_dir_with(tmp_path, events=[START])
    report = status.build_report(
        run, JOB, status.SlurmView(False, error="scontrol not found (not a Slurm machine)")
    )
    assert report["state"] == "unknown" and "Slurm was not reachable" in report["advice"][0]
    assert "Slurm job      4242: Slurm was not reachable (scontrol not found" in "\n".join(
        status.render(report)
    )


def test_status_of_a_directory_that_is_no_run_exits_2(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == f"rollhpc status: {tmp_path} is not a run directory (no config.yaml); pass runs/NAME of a "
        "run rollhpc started"
    )


def test_hold_watch_speaks_and_releases_once_per_attempt(monkeypatch, capsys):
    attempts = iter([0, 0, 0, 1, 1])
    monkeypatch.setattr(
        slurm,
        "job_records",
        lambda job_id: (
            [
                {
                    "JobId": job_id,
                    "JobState": "PENDING",
                    "Reason": "JobHeldUser",
                    "Restarts": str(next(attempts)),
                }
            ],
            "",
        ),
    )
    released = []
    monkeypatch.setattr(
        slurm.HoldWatch, "_release", lambda self, attempt, reason: released.append(attempt)
    )
    watch = slurm.HoldWatch(JOB, release=True, run_dir=None, grace_s=0)
    for _ in range(5):
        watch.poll()
    assert released == [0, 1]
    assert capsys.readouterr().err.count(f"rollhpc: job {JOB} is held by Slurm (JobHeldUser)") == 2
    # a requeuehold in passing
    patient = slurm.HoldWatch(JOB, release=True, run_dir=None, grace_s=3600)
    attempts = iter([2, 2])
    patient.poll(), patient.poll()
    assert released == [0, 1]


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_held_job_on_real_slurm_is_reported_and_released_by_the_wait(
    slurm_cluster, tmp_path, monkeypatch, capsys
):
    run = run_dir_with(tmp_path, events=[START])
    job = slurm_cluster.sbatch("--hold", "-o", str(tmp_path / "held.out"), "--wrap", "sleep 1")
    (run / "slurm" / "job_id").write_text(job + "\n")
    env = {**slurm_cluster.env, "PYTHONPATH": cli_env()["PYTHONPATH"]}
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "status", str(run)],
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert (
        f"held: job {job} is held by Slurm (JobHeldUser): release it with: scontrol release {job}"
        in res.stdout
    )

    for key in ("SLURM_CONF", "PATH"):  # the wait polls with this process's environment
        monkeypatch.setenv(key, slurm_cluster.env[key])
    state = slurm.wait_for_job(
        job, poll_s=0.2, timeout_s=60, release_held=True, run_dir=run, held_grace_s=0
    )
    assert state == "COMPLETED"
    assert f"rollhpc: job {job} is held by Slurm (JobHeldUser)" in capsys.readouterr().err
    # requeued held again (a second attempt, as after a failed launch): released again, as attempt 1 (Slurm
    # makes a requeued job wait several seconds before it may start: the test does not wait for that)
    slurm_cluster.run(["scontrol", "requeuehold", job])
    slurm.HoldWatch(job, release=True, run_dir=run, grace_s=0).poll()
    slurm_cluster.run(["scancel", job])
    releases = [e for e in read_events(run) if e["event"] == "release"]
    assert [(e["job_id"], e["slurm_restart_count"], e["ok"]) for e in releases] == [
        (job, 0, True),
        (job, 1, True),
    ]
    assert "held by Slurm (job requeued in held state)" in releases[1]["reason"]


def test_a_job_with_its_rescue_pending_is_recovering_naming_the_failure(tmp_path):
    lost = {
        **REQUEUE,
        "failure": {
            "kind": "lost_worker",
            "hosts": ["node2"],
            "summary": "worker rank 3 (role "
            "'train') died; the error that surfaced first was its echo: ... gloo ...",
        },
    }
    run = run_dir_with(tmp_path, events=[START, lost, START])
    view = status.SlurmView(True, "sacct", [{"JobId": f"{JOB}+0", "JobState": "NODE_FAIL"}])
    rescue = status.SlurmView(True, "scontrol", [{"JobId": "4250", "JobState": "PENDING"}])
    report = status.build_report(run, JOB, view, rescue_id="4250", rescue=rescue)
    assert report["state"] == "recovering"
    assert report["advice"][0].startswith(
        f"job {JOB} ended NODE_FAIL before its batch script could continue the "
        "run: its rescue job 4250 (PENDING) continues it from step_000004"
    )
    text = "\n".join(status.render(report))
    assert "last failure   a lost worker (node or process gone), restarted without node2" in text
    assert "rescue job     4250 (PENDING)" in text
    # once the rescue has gone the way of the job, its word is in restarts.jsonl: the usual verdicts follow
    done = status.SlurmView(True, "sacct", [{"JobId": "4250", "JobState": "CANCELLED"}])
    assert status.build_report(run, JOB, view, rescue_id="4250", rescue=done)["state"] == "ended"


def test_the_same_failure_twice_and_an_error_of_the_runs_own_are_failed_runs(tmp_path):
    twice = {
        "time": "2026-01-01T10:09:00+0000",
        "event": "end",
        "status": 76,
        "final": True,
        "failure": {"kind": "lost_peer", "summary": "gloo: Connection closed by peer"},
        "reason": "the same failure twice in a row at step 5 with no node found lost (...): taken as "
        "deterministic, not restarted again",
    }
    report = report_for(
        run_dir_with(tmp_path, events=[START, REQUEUE, START, twice]), sacct={f"{JOB}+0": "FAILED"}
    )
    assert report["state"] == "failed" and report["advice"][0].startswith(
        "not restarted again: the same failure"
    )
    own = {
        **twice,
        "status": 1,
        "failure": {"kind": "error", "summary": "ValueError: bad row"},
        "reason": "...",
    }
    report = report_for(
        run_dir_with(tmp_path / "b", events=[START, own]), sacct={f"{JOB}+0": "FAILED"}
    )
    assert report["state"] == "failed" and "an error of the run's own" in report["advice"][0]
    assert "last failure   an error of the run's own, ended" in "\n".join(status.render(report))
