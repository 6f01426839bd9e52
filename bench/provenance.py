"""What a benchmark's result file records about the code that produced it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_result(path: Path, result: dict) -> None:
    """A benchmark's result file: indented JSON, written atomically (its folder made if needed)."""
    from rollhpc.rundir import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")


def write_figure(path: Path, fig, dpi: int = 100) -> None:  # noqa: ANN001 - a matplotlib Figure
    """A benchmark's PNG: laid out, written atomically beside its result file, and the figure closed."""
    import matplotlib.pyplot as plt

    from rollhpc.rundir import atomic_file

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)


def commit() -> str:
    """HEAD's hash, with ``+dirty`` when tracked files differ from it (then the numbers are not from a commit).
    bench/results/ does not count: a benchmark that writes several result files would otherwise call its own
    second one dirty."""
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head + ("+dirty" if dirty else "")
