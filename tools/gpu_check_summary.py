"""One JSON of what tools/gpu_check.sh measured, from its output folder: the machine (env.log), each step's status
and seconds, the -m gpu tests' outcomes (JUnit XML) and numbers (gpu_tests.jsonl), the copy bandwidths, and per
RLVR run its held-out accuracy by step, seconds per step, the weights' sha256 and its start-up turns, and the
cluster check's table.

    python tools/gpu_check_summary.py OUT [--commit SHA] [--out FILE]

gpu_check.sh writes OUT/summary.json with it at the end; a lent machine's folder copied back can be summarised
here too (--commit: the tree it ran, when it is not this one's HEAD).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollhpc.rundir import atomic_write_json, read_jsonl  # noqa: E402


def _env(path: Path) -> dict[str, str]:
    lines = (
        [x for x in path.read_text().splitlines() if x and not x.startswith("+ ")]
        if path.is_file()
        else []
    )
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        if line.startswith("name, memory.total") and i + 1 < len(lines):
            out["gpu"] = lines[i + 1]
        elif line.startswith("torch "):
            out["torch"] = line
        elif line[:1].isdigit() and "GCC" in line:
            out["python"] = line.split()[0]
    return out


def _tests(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    outcome = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome[case.get("name", "?")] = (
            "skipped" if case.find("skipped") is not None else ("failed" if failed else "passed")
        )
    return outcome


def _exit(path: Path) -> str:
    """How the run ended, from its controller-exit.json: "finished", or the failure's kind and summary's first line."""
    if not path.is_file():
        return "no controller-exit.json (the run did not end by itself)"
    record = json.loads(path.read_text())
    failure = record.get("failure")
    if record.get("status") == 0 and not failure:
        return "finished"
    if failure:
        return f"{failure.get('kind')}: {str(failure.get('summary', '')).splitlines()[0]}"
    return f"status {record.get('status')}"


def _startup(path: Path) -> list[dict[str, Any]] | None:
    """The start-up turns of a run (RUN_DIR/startup.json): each turn's roles, the seconds its ranks took to build,
    and whether every one of them began building after the previous turn was ready (the colocated order)."""
    if not path.is_file():
        return None
    turns, before = [], None
    for turn in json.loads(path.read_text())["turns"]:
        built = [b for b in turn["ranks"].values() if b]
        turns.append(
            {
                "roles": turn["roles"],
                "offloaded": turn.get("offloaded", {}),
                "build_s": max((end - start for start, end in built), default=None),
                "after_previous": None
                if before is None
                else all(start >= before for start, _ in built),
            }
        )
        before = turn["ready"]
    return turns


def _rlvr(folder: Path) -> dict[str, Any]:
    runs = {}
    for metrics in sorted(folder.glob("*/metrics.jsonl")):
        rows = read_jsonl(metrics)
        steps = [r["step_s"] for r in rows if "step_s" in r]
        runs[metrics.parent.name] = {
            "steps": max((r.get("step", 0) for r in rows), default=0),
            "accuracy": {r["step"]: r["accuracy"] for r in rows if "accuracy" in r},
            "median_step_s": statistics.median(steps) if steps else None,
            "weights_sha256": next(
                (r["weights_sha256"] for r in reversed(rows) if "weights_sha256" in r), None
            ),
            "exit": _exit(metrics.parent / "controller-exit.json"),
            "startup": _startup(metrics.parent / "startup.json"),
        }
    return runs


def _cluster_check(folder: Path) -> dict[str, Any] | None:
    """The cluster check's verdict and its table's rows (check, what, planned, measured, ok), without raw values."""
    found = sorted(folder.glob("*/cluster_check.json"))
    if not found:
        return None
    table = json.loads(found[-1].read_text())
    keys = ("check", "what", "planned", "measured", "ok")
    return {
        "passed": table.get("passed"),
        "rows": [{k: r.get(k) for k in keys} for r in table.get("rows", [])],
    }


def summarize(out: Path, commit: str | None) -> dict[str, Any]:
    if commit is None:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    bandwidth = out / "bandwidth.json"
    return {
        "commit": commit,
        "machine": _env(out / "env.log"),
        "steps": read_jsonl(out / "steps.jsonl") if (out / "steps.jsonl").is_file() else [],
        "gpu_tests": _tests(out / "gpu_tests.xml"),
        "gpu_numbers": {r.pop("test"): r for r in read_jsonl(out / "gpu_tests.jsonl")}
        if (out / "gpu_tests.jsonl").is_file()
        else {},
        "bandwidth": json.loads(bandwidth.read_text()) if bandwidth.is_file() else None,
        "rlvr": _rlvr(out / "rlvr"),
        "cluster_check": _cluster_check(out / "cluster_check"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="gpu_check.sh's output folder")
    ap.add_argument("--commit", help="the commit the check ran (default: this tree's HEAD)")
    ap.add_argument("--out", dest="dest", type=Path, help="default: OUT/summary.json")
    args = ap.parse_args(argv)
    summary = summarize(args.out, args.commit)
    atomic_write_json(args.dest or args.out / "summary.json", summary)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
