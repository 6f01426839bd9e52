"""``rollhpc status RUN_DIR``: where a Slurm run stands and what, if anything, its user has to do.

A run's state is spread over its directory (config.yaml, metrics.jsonl, restarts.jsonl, checkpoints/,
error.json, slurm/job_id) and Slurm's view of its job (each het component's state, pending reason,
nodes, restart count). Both are read separately -- ``query_slurm`` is the only part that talks to Slurm
-- and ``build_report`` combines them with pure logic, so every case (held, failed, out of restarts,
finished, running) is testable from hand-made inputs.

A held job is the one case that needs a person (or ``cluster.release_held``): Slurm requeues a job whose
launch failed *held* ("launch failed requeued held") and it then waits forever. ``slurm_cli.held_reason`` is the one
place that recognises it; ``rollhpc submit --wait`` (``launch.slurm.wait_for_job``) uses it too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollhpc.checkpoint.report import resume_choice
from rollhpc.checkpoint.storage import CheckpointStore
from rollhpc.launch.finished import configured_steps, finished_run
from rollhpc.launch.slurm_cli import (
    TERMINAL,
    component_states,
    held_notice,
    held_reason,
    job_records,
)
from rollhpc.observability.metrics import read_metrics
from rollhpc.rundir import RunPaths
from rollhpc.rundir.failure_kind import FailureKind
from rollhpc.rundir.records import CONTINUATION, FAILURE, read_events, restarts_by_cause

# Restarts: what sacct and squeue call RestartCnt (the job's attempt number)
SCONTROL_FIELDS = (
    "JobId",
    "JobState",
    "Reason",
    "NodeList",
    "ExcNodeList",
    "Restarts",
    "BatchHost",
)
ENDED_BADLY = TERMINAL - {"COMPLETED"}  # FAILED, CANCELLED, NODE_FAIL, TIMEOUT, ...
LAST_EVENTS = 5  # restarts.jsonl events shown


class NotARunDirectory(ValueError):
    """The path given to ``rollhpc status`` holds no run (no config.yaml)."""


# ---- Slurm's view ----


@dataclass
class SlurmView:
    """What Slurm says about a job: one record per het component (``scontrol show job -o`` fields, or only
    JobId/JobState from sacct once slurmctld has forgotten the job). ``reachable`` is False off a Slurm
    machine or when the controller does not answer; then ``error`` says why."""

    reachable: bool
    source: str = ""  # "scontrol", "sacct" or "" (nobody knows the job)
    components: list[dict[str, str]] = field(default_factory=list)
    error: str = ""


def query_slurm(job_id: str) -> SlurmView:
    """scontrol's records of the job; sacct's component states when scontrol no longer knows it."""
    records, error = job_records(job_id)
    if records:
        return SlurmView(True, "scontrol", components_of(records))
    if shutil.which("sacct") is None:
        return SlurmView(records is not None, error=error)
    try:
        states = component_states(job_id)
    except (OSError, subprocess.TimeoutExpired) as e:
        return SlurmView(records is not None, error=error or f"sacct: {e}")
    if states:
        return SlurmView(
            True, "sacct", [{"JobId": jid, "JobState": st} for jid, st in states.items()]
        )
    # sacct says nothing also when it fails: the job is unknown only if slurmctld answered
    return SlurmView(records is not None, error=error)


def components_of(records: list[Mapping[str, str]]) -> list[dict[str, str]]:
    """scontrol's records cut to the fields the report shows; a het component is named "123+1" (sacct's
    name for it) rather than by its own job id."""
    out = []
    for r in records:
        het, offset = r.get("HetJobId", ""), r.get("HetJobOffset", "")
        name = {"Component": f"{het}+{offset}"} if het and offset and het != "(null)" else {}
        out.append({k: r.get(k, "") for k in SCONTROL_FIELDS} | name)
    return out


# ---- the run directory ----


def check_run_dir(path: Path) -> Path:
    """The run directory, resolved; NotARunDirectory unless it holds a config.yaml."""
    path = Path(path)
    if not RunPaths(path).config.is_file():
        why = "no config.yaml" if path.is_dir() else "no such directory"
        raise NotARunDirectory(
            f"{path} is not a run directory ({why}); pass runs/NAME of a run rollhpc started"
        )
    return path.resolve()


def job_id_of(run_dir: Path) -> str | None:
    """The run's last Slurm job (``rollhpc submit`` writes RUN_DIR/slurm/job_id); None for a local run."""
    path = RunPaths(run_dir).job_id
    return (path.read_text().strip() or None) if path.is_file() else None


def _last_step(run_dir: Path) -> tuple[int | None, str]:
    """(step of metrics.jsonl's last line, a note when it cannot be read)."""
    path = RunPaths(run_dir).metrics
    if not path.exists():
        return None, "no metrics.jsonl yet"
    try:
        records = read_metrics(path)
    except ValueError:
        return None, "metrics.jsonl has a torn line (a crash while writing; a resume cuts it off)"
    return (records[-1].get("step") if records else None), ""


def _checkpoint(run_dir: Path) -> dict[str, Any]:
    """The checkpoint a resume would use (as ``rollhpc ckpt list`` picks it, sizes checked) and the newer
    ones it would skip."""
    rows = [
        r
        for r in CheckpointStore(RunPaths(run_dir).checkpoints).statuses(deep=False)
        if not r.name.startswith(".")
    ]
    good = resume_choice(rows)
    skipped = [
        f"{r.name}: {r.status}: {r.problems[0]}"
        for r in rows
        if r.status != "ok" and (good is None or r.step > good.step)
    ]
    if good is None:
        return {"newest_good": None, "skipped": skipped}
    assert good.manifest is not None
    return {
        "newest_good": {
            "name": good.name,
            "step": good.step,
            "path": str(good.path),
            "written": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(good.manifest.created)),
        },
        "skipped": skipped,
    }


def _error(run_dir: Path) -> dict[str, Any] | None:
    path = RunPaths(run_dir).error
    if not path.exists():
        return None
    try:
        err = json.loads(path.read_text())
    except ValueError:
        return {"summary": "error.json is unreadable", "path": str(path)}
    return {
        "summary": err.get("summary", ""),
        "type": err.get("type", ""),
        "time": err.get("time", ""),
        "path": str(path),
    }


# ---- the report ----


def last_failure(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest failure verdict in restarts.jsonl (``rollhpc.controller.failure``, recorded with the restart or
    end it led to), with what followed: "restarted" or "ended"."""
    for e in reversed(events):
        if e.get("failure"):
            return {
                **e["failure"],
                "then": "restarted" if e.get("event") == "requeue" else "ended",
                "time": e.get("time", ""),
            }
    return None


def build_report(
    run_dir: Path,
    job_id: str | None,
    slurm: SlurmView | None,
    *,
    rescue_id: str | None = None,
    rescue: SlurmView | None = None,
) -> dict[str, Any]:
    """Everything ``rollhpc status`` says, as JSON-able data: the run directory's part, Slurm's part
    (``slurm`` None: no job recorded; ``rescue``: what Slurm says of the job's rescue job, ``rescue_id``),
    and the verdict (``state``) with what to do about it (``advice``)."""
    run_dir = Path(run_dir)
    step, step_note = _last_step(run_dir)
    events = read_events(run_dir)
    starts = sum(e.get("event") == "start" for e in events)
    requeues = sum(e.get("event") == "requeue" for e in events)
    causes = restarts_by_cause(events)
    report: dict[str, Any] = {
        "run_dir": str(run_dir),
        "job_id": job_id,
        "slurm": None if slurm is None else asdict(slurm),
        "step": step,
        "steps": configured_steps(run_dir),
        "finished": finished_run(run_dir),
        "step_note": step_note,
        # Slurm's own requeues (a lost batch node) log no requeue, only the next start
        "restarts": {
            "restarts": max(starts - 1, requeues),
            "attempts": starts,
            "requeues": requeues,
            # the requeues by cause: failures use up cluster.max_restarts, continuations after a time limit do not
            "failures": causes[FAILURE],
            "continuations": causes[CONTINUATION],
            "events": len(events),
            "last": events[-LAST_EVENTS:],
        },
        "checkpoint": _checkpoint(run_dir),
        "error": _error(run_dir),
        "last_failure": last_failure(events),
        "rescue": None
        if rescue_id is None
        else {
            "job_id": rescue_id,
            "states": sorted({c.get("JobState", "") for c in (rescue.components if rescue else [])})
            or ["unknown to Slurm"],
        },
        "job_output": [str(p) for p in sorted(RunPaths(run_dir).slurm.glob("job-*.out"))],
    }
    report["state"], report["advice"] = verdict(report, events)
    return report


Verdict = tuple[str, list[str]]  # (state, advice)


def _live_job(job_id: str | None, comps: list[dict[str, str]]) -> Verdict | None:
    """Slurm's word on a job it still holds, runs or has waiting: held, pending or running."""
    held = [why for c in comps if (why := held_reason(c))]
    if held:
        return "held", [
            held_notice(job_id, held[0]),
            "(the run's own jobs are --no-requeue, so Slurm never holds "
            "them after a failed launch: a person or the site held this one; `rollhpc submit --wait` "
            "releases it itself, once per attempt, with cluster.release_held=true)",
        ]
    active = [c for c in comps if c.get("JobState") not in TERMINAL]
    if active and all(c.get("JobState") == "PENDING" for c in active):
        return "pending", [
            f"waiting for Slurm to start it (reason: {active[0].get('Reason') or 'none given'}); "
            "nothing to do"
        ]
    if active:
        return "running", [
            "nothing to do: after a time limit or a lost node it continues by itself (in a new "
            "job, which RUN_DIR/slurm/job_id and this command follow)"
        ]
    return None


def _recovering(report: Mapping[str, Any], comps: list[dict[str, str]]) -> Verdict | None:
    """The job ended and its rescue job, still alive, continues the run."""
    rescue = report.get("rescue") or {}
    if not comps or not any(
        st not in TERMINAL and st != "unknown to Slurm" for st in rescue.get("states", [])
    ):
        return None
    states = "/".join(sorted({c.get("JobState", "") for c in comps}))
    good = report["checkpoint"]["newest_good"]
    return "recovering", [
        f"job {report['job_id']} ended {states} before its batch script could continue the run: its "
        f"rescue job {rescue['job_id']} ({'/'.join(rescue['states'])}) continues it "
        f"{'from ' + good['name'] if good else 'from the start'} in a new job as soon as "
        "Slurm starts it; nothing to do"
    ]


def _finished(report: Mapping[str, Any]) -> Verdict | None:
    if not report["finished"] and (
        report["step"] is None or report["step"] != report["steps"] or report["error"] is not None
    ):
        return None
    why = f" ({report['finished']})" if report["finished"] else ""
    metrics = Path(report["run_dir"]) / "metrics.jsonl"
    return "finished", [f"all {report['steps']} steps done{why}; metrics in {metrics}"]


def _decided_end(report: Mapping[str, Any], last: Mapping[str, Any]) -> Verdict | None:
    """The run's final end, as the requeue or the rescue decided it: out of restarts, the same failure
    twice, or an error of the run's own."""
    if last.get("event") != "end":
        return None
    reason = str(last.get("reason", ""))
    if last.get("bound") == "max_continuations":
        return "gave_up", [
            f"out of continuations (cluster.max_continuations): {reason}",
            *_resume_advice(report),
        ]
    if last.get("bound") == "max_restarts" or "giving up" in reason:
        return "gave_up", [
            f"out of restarts after failures (cluster.max_restarts): {reason}",
            *_resume_advice(report),
        ]
    if "the same failure twice in a row" in reason:
        return "failed", [f"not restarted again: {last['reason']}", *_resume_advice(report)]
    if (last.get("failure") or {}).get("kind") == FailureKind.DISK_FULL:
        return "failed", [last["failure"].get("summary", reason), *_resume_advice(report)]
    if (last.get("failure") or {}).get("kind") == FailureKind.ERROR:
        return "failed", [
            "an error of the run's own code or data ended it (a restart would meet it again): fix "
            "it, then continue",
            *_resume_advice(report),
        ]
    return None


def _ended_or_unknown(
    report: Mapping[str, Any], last: Mapping[str, Any], slurm: Mapping[str, Any]
) -> Verdict:
    """What is left once no live job, rescue, finish or decision explains the run: how its job ended, a
    local run, or a job Slurm cannot tell about."""
    job_id, run_dir = report["job_id"], Path(report["run_dir"])
    comps = slurm.get("components", [])
    bad = sorted({c.get("JobState", "") for c in comps} & ENDED_BADLY)
    if bad:
        return "ended", [f"the job ended {', '.join(bad)}", *_resume_advice(report)]
    if job_id is None:
        return "local", [
            "no Slurm job recorded (RUN_DIR/slurm/job_id): a local run; continue it with: rollhpc "
            f"train {run_dir / 'config.yaml'} run.output_dir={run_dir.parent} --resume"
        ]
    if comps or last.get("event") == "end":
        return "ended", [
            f"the job ended at step {report['step']} of {report['steps'] or '?'}",
            *_resume_advice(report),
        ]
    if not slurm.get("reachable"):
        return "unknown", [
            f"Slurm was not reachable ({slurm.get('error') or 'no answer'}): run this on the "
            "cluster's login node to see the job"
        ]
    return "unknown", [
        f"Slurm no longer knows job {job_id} and the run did not record an end; if it is not running, "
        "continue it:",
        *_resume_advice(report),
    ]


def verdict(report: Mapping[str, Any], events: list[dict[str, Any]]) -> Verdict:
    """(state, advice): held, pending, running, recovering (the job ended; its rescue job continues the run),
    finished, gave_up, failed (an error of its own, or the same failure twice), ended (badly, or short of its
    steps), local or unknown. Slurm's word comes first (a live job is what Slurm says), then the run directory's."""
    slurm = report["slurm"] or {}
    comps = slurm.get("components", [])
    last = events[-1] if events else {}
    return (
        _live_job(report["job_id"], comps)
        or _recovering(report, comps)
        or _finished(report)
        or _decided_end(report, last)
        or _ended_or_unknown(report, last, slurm)
    )


def _resume_advice(report: Mapping[str, Any]) -> list[str]:
    run_dir = Path(report["run_dir"])
    lines = []
    if report["error"]:
        lines.append(f"why: {report['error']['summary']} (details in {report['error']['path']})")
    if report["job_output"]:
        lines.append(f"the job's output: {report['job_output'][-1]}")
    good = report["checkpoint"]["newest_good"]
    start = f"from {good['name']}" if good else "from the start (no good checkpoint)"
    lines += [
        f"continue with: slurm/resume.sh {run_dir}   ({start})",
        f"  or: rollhpc submit {run_dir / 'config.yaml'} run.output_dir={run_dir.parent} --resume",
    ]
    return lines


def render(report: Mapping[str, Any]) -> list[str]:
    """The report as lines for a person."""
    lines = [f"run directory  {report['run_dir']}"]
    lines += _render_slurm(report)
    step, steps = report["step"], report["steps"]
    lines.append(
        f"step           {'-' if step is None else step} of {steps if steps is not None else '?'}"
        + (f"  ({report['step_note']})" if report["step_note"] else "")
    )
    r = report["restarts"]
    lines.append(
        f"restarts       {r['restarts']} ({r['attempts']} attempt(s) started, {r['requeues']} requeue(s): "
        f"{r['failures']} after failures, {r['continuations']} after a time limit)"
        + (f"; the last {len(r['last'])} of {r['events']} events:" if r["last"] else "")
    )
    lines += [f"  {_event_line(e)}" for e in r["last"]]
    ck = report["checkpoint"]
    good = ck["newest_good"]
    lines.append(
        f"checkpoint     {good['name']} (step {good['step']}, written {good['written']})"
        if good
        else "checkpoint     none good (a resume starts from the beginning)"
    )
    lines += [f"  skipped: {s}" for s in ck["skipped"]]
    if report["error"]:
        lines.append(f"error          {report['error']['summary']}")
    if failure := report.get("last_failure"):
        # a kind this rollhpc does not know shows as recorded
        kind = FailureKind.of(failure.get("kind"))
        lines.append(
            f"last failure   {failure.get('kind') if kind is None else kind.description}, {failure['then']}"
            + (f" without {', '.join(failure['hosts'])}" if failure.get("hosts") else "")
            + (f" ({failure['time']})" if failure.get("time") else "")
        )
        lines.append(f"  {failure.get('summary', '')[:400]}")
    if report.get("rescue"):
        lines.append(
            f"rescue job     {report['rescue']['job_id']} ({'/'.join(report['rescue']['states'])}): "
            "continues the run should this job end without its batch script"
        )
    lines += [
        "",
        f"{report['state']}: {report['advice'][0]}",
        *(f"  {a}" for a in report["advice"][1:]),
    ]
    return lines


def _render_slurm(report: Mapping[str, Any]) -> list[str]:
    slurm, job_id = report["slurm"], report["job_id"]
    if slurm is None:
        return ["Slurm job      none recorded (a local run)"]
    if not slurm["reachable"]:
        return [f"Slurm job      {job_id}: Slurm was not reachable ({slurm['error']})"]
    if not slurm["components"]:
        return [f"Slurm job      {job_id}: unknown to Slurm (scontrol and sacct no longer list it)"]
    lines = [f"Slurm job      {job_id} (from {slurm['source']})"]
    for c in slurm["components"]:
        parts = [c.get("Component") or c["JobId"], c["JobState"]]
        if c.get("Reason") and c["Reason"] != "None":
            parts.append(f"reason {c['Reason']}")
        for key, label in (
            ("NodeList", "nodes"),
            ("ExcNodeList", "excluded"),
            ("BatchHost", "batch host"),
            ("Restarts", "Slurm restarts"),
        ):
            if c.get(key) and c[key] != "(null)":
                parts.append(f"{label} {c[key]}")
        lines.append("  " + "  ".join(parts))
    return lines


def _event_line(e: Mapping[str, Any]) -> str:
    kind = e.get("event", "?")
    if kind == "start":
        what = (
            f"job {e.get('job_id')}, restart {e.get('restart', e.get('slurm_restart_count'))}, nodes "
            f"{','.join(e.get('nodes') or []) or '?'}; previous attempt: {e.get('previous_attempt') or '-'}"
        )
    elif kind == "resume":
        what = (
            f"resumed after step {e.get('step')} from {e.get('checkpoint')}"
            if e.get("checkpoint")
            else "started again from step 0 (lost before its first checkpoint)"
        )
    elif kind == "requeue":
        what = (
            e.get("reason", "")
            + (f" (excluding {','.join(e['exclude'])})" if e.get("exclude") else "")
            + (f"; continued as job {e['new_job_id']}" if e.get("new_job_id") else "")
        )
    elif kind == "end":
        what = f"status {e.get('status')}" + (f": {e['reason']}" if e.get("reason") else "")
    else:
        what = str(e.get("reason") or {k: v for k, v in e.items() if k not in ("time", "event")})
    return f"{e.get('time', '?')}  {kind:<8} {what}"
