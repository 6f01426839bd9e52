"""`rollhpc report` on metrics written here (the end-to-end runs check it through tests/conftest.assert_report):
training.png has a panel per quantity some run logged and none for the rest, two runs of one name are told
apart by their directories, and a report without training metrics leaves no stale training.png behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

from PIL import Image

from rollhpc.observability.report import _labels, _smoothed, load_run, logged_panels, write_report


def write_run(run_dir: Path, steps: int, keys: tuple[str, ...]) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(steps + 1):
        record = {
            "step": step,
            "time": 1_800_000_000.0 + 2 * step,
            "reward_mean": math.sin(step) + step / 10,
        }
        if step:
            record |= {
                "step_s": 2.0,
                "train_s": 1.0,
                "eval_s": 0.5,
                **{k: 1.0 / step + (step % 3) for k in keys},
            }
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def axes_of(png: Path) -> int:
    with Image.open(png) as img:
        return int(img.info["Description"].removeprefix("axes="))


def test_training_panels_are_those_logged_and_same_named_runs_differ(tmp_path):
    a = write_run(
        tmp_path / "a" / "x", 30, ("train/loss", "train/grad_norm", "response_len_mean", "train/kl")
    )
    b = write_run(tmp_path / "b" / "x", 30, ("train/loss", "train/entropy"))
    runs = [load_run(a), load_run(b)]
    # the clip fraction: nobody
    assert [p[0] for p in logged_panels(runs)] == [
        "train/loss",
        "train/grad_norm",
        "response_len_mean",
        "train/entropy",
        "train/kl",
    ]
    assert _labels(runs) == [str(a), str(b)] and _labels(runs[:1]) == ["x"]
    written = write_report([a, b], tmp_path / "cmp")
    assert {p.name for p in written} == {
        "learning.png",
        "throughput.png",
        "training.png",
        "stages.png",
        "summary.txt",
    }
    assert (
        axes_of(tmp_path / "cmp" / "training.png") == 5
        and axes_of(tmp_path / "cmp" / "learning.png") == 4
    )

    bare = write_run(tmp_path / "bare", 3, ())
    (bare / "report").mkdir()
    (bare / "report" / "training.png").write_bytes(b"an earlier report's")
    assert "training.png" not in {p.name for p in write_report([bare], bare / "report")}
    assert not (bare / "report" / "training.png").exists()


def test_a_run_with_both_log_probs_gets_the_mismatch_figure(tmp_path):
    run = write_run(tmp_path / "m", 10, ("train/loss", "mismatch_kl", "correction_masked_frac"))
    written = {p.name for p in write_report([run], run / "report")}
    assert "mismatch.png" in written and axes_of(run / "report" / "mismatch.png") == 2


def test_the_smoothed_line_follows_the_trend_not_the_noise():
    noisy = [float(i % 2) for i in range(100)]  # 0, 1, 0, 1, ...: mean 0.5
    smooth = _smoothed(noisy)
    assert len(smooth) == 100 and all(0.3 < v < 0.7 for v in smooth[50:])
