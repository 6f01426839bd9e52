"""What a finished run's `rollhpc report` must show: every figure a real PNG with its axes, and the summary."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from rollhpc.observability.report import load_run, logged_panels
from tests.support.processes import rollhpc


# + training.png: a panel per logged quantity
REPORT_AXES = {
    "learning.png": 4,
    "throughput.png": 2,
    "stages.png": 1,
}


def assert_report(run_dir: Path, cwd: Path) -> str:
    """Run ``rollhpc report RUN_DIR``; check that every figure is a non-empty PNG with its expected number
    of axes (recorded in the PNG's Description chunk); returns summary.txt."""
    res = rollhpc("report", str(run_dir), cwd=cwd, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    panels = len(logged_panels([load_run(run_dir)]))
    assert panels >= 2, "a training run logs at least its loss and response length"
    for name, axes in {**REPORT_AXES, "training.png": panels}.items():
        with Image.open(run_dir / "report" / name) as img:
            assert img.format == "PNG" and img.width > 500 and img.height > 200, (name, img.size)
            assert img.info.get("Description") == f"axes={axes}", (name, img.info)
            low, high = img.convert("L").getextrema()
            assert high - low > 100, f"{name} looks blank"
    summary = (run_dir / "report" / "summary.txt").read_text()
    assert summary in res.stdout
    return summary
