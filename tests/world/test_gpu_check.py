"""tools/gpu_check.sh, the prepared check for a lent GPU machine, in its dry run: every step is listed and
recorded, and the 1-GPU RLVR run it would start is a configuration `rollhpc train` accepts (checked with
--dry-run here, so a renamed option fails in CI rather than in the few minutes of a GPU loan)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from tests.support.processes import REPO, cli_env


def test_the_dry_run_lists_every_step_and_its_training_run_is_valid(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [
        "env",
        "install",
        "gpu",
        "bandwidth",
        "rlvr",
        "cluster_check",
    ]
    assert all(s["status"] == 0 and s["dry_run"] for s in steps)
    commands = [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]
    assert any("-m pytest -m gpu tests/world/test_gpu.py" in c for c in commands)
    assert not (out / "venv").exists(), "a dry run installs nothing"
    trains = [shlex.split(c) for c in commands if " -m rollhpc.cli train " in c]
    assert [t[t.index("--overwrite") + 1] for t in trains] == [
        "run.name=offload-true",
        "run.name=offload-false",
        f"run.output_dir={out}/cluster_check",
    ]
    for train in trains:
        check = subprocess.run(
            [sys.executable, *train[1:], "--dry-run"],
            cwd=REPO,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert check.returncode == 0, check.stderr
        assert "rollhpc.rank" in check.stdout  # the world it would start
