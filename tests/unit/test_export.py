"""``rollhpc export``'s input errors, before any conversion starts: each one line, exit status 2, nothing
written (fast: a checkpoint store of committed step directories, no world, no model). The export itself (a
run's checkpoint -> HF, loaded by transformers and vLLM) and ``pipeline.options.export_hf: final`` are
tested on the quickstart's run in tests/world/test_requeue.py; the generation config derived for a model that had
none in tests/world/test_convert.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollhpc.checkpoint.storage import CheckpointStore
from rollhpc.cli import main


def _run_dir(root: Path) -> Path:
    """A run directory with the checkpoints of steps 2 (a trainer model: only its metadata file, which is all
    the input checks read) and 4 (controller state only), and a damaged one of step 6."""
    run = root / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: r}\n")
    store = CheckpointStore(run / "checkpoints")
    for step, files in (
        (2, ("train/model/rollhpc_checkpoint.json", "controller/state.pkl")),
        (4, ("controller/state.pkl",)),
        (6, ("train/model/rollhpc_checkpoint.json",)),
    ):
        pending = store.begin(step)
        for rel in files:
            (pending.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (pending.path / rel).write_text("{}")
        store.commit(pending)
    (
        run / "checkpoints" / "step_000006" / "train" / "model" / "rollhpc_checkpoint.json"
    ).write_text("{} ")
    return run


def _export(capsys, *args: str) -> tuple[int, str]:
    try:
        rc = main(["export", *map(str, args)])
    except SystemExit as e:  # argparse's own errors: the subcommand's usage, exit 2
        rc = e.code
    return rc, capsys.readouterr().err.strip()


def test_export_input_errors_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    run = _run_dir(tmp_path)
    out = tmp_path / "out"
    (tmp_path / "plain").mkdir()
    (tmp_path / "exists").mkdir()
    cases = [
        ((tmp_path / "nowhere", out), f"{tmp_path / 'nowhere'}: no such directory"),
        (
            (tmp_path / "plain", out),
            f"{tmp_path / 'plain'} is not a run directory (no config.yaml, no checkpoints/)",
        ),
        (
            (run / "checkpoints" / "step_000002", out),
            f"{run / 'checkpoints' / 'step_000002'} is one checkpoint of a "
            f"run: give the run directory and the step, `rollhpc export "
            f"{run} --step 2 OUT_DIR`",
        ),
        (
            (run, out, "--step", "3"),
            f"{run}: no good checkpoint of step 3; steps there: 2, 4, 6 (corrupt)",
        ),
        (
            (run, out, "--step", "6"),
            f"{run}: no good checkpoint of step 6 (train/model/rollhpc_checkpoint.json: 3 "
            "bytes, the manifest says 2 (grown)); steps there: 2, 4, 6 (corrupt)",
        ),
        ((run, out, "--step", "4"), f"{run / 'checkpoints' / 'step_000004'} holds no train model"),
        (
            (run, out),
            f"{run / 'checkpoints' / 'step_000004'} holds no train model",
        ),  # the newest good one
        (
            (run, tmp_path / "exists", "--step", "2"),
            f"{tmp_path / 'exists'} exists; pass --overwrite to replace it",
        ),
        ((run, run, "--step", "2", "--overwrite"), f"{run} holds the run's checkpoints"),
        (
            (run, run / "checkpoints" / "hf", "--step", "2"),
            f"{run / 'checkpoints' / 'hf'} is inside the run's checkpoints",
        ),
        (
            (run, out, "--step", "2", "--max-shard-size", "2XB"),
            "size '2XB': expected a number with an optional unit",
        ),
        (
            (run, out, "--step", "-1"),
            "rollhpc export: error: argument --step: expected a step number >= 0, got '-1'",
        ),
        ((run, out, "steps=2"), "rollhpc export: error: unrecognized arguments: steps=2"),
    ]
    for args, expected in cases:
        rc, err = _export(capsys, *args)
        assert rc == 2, (args, err)
        if "usage:" in err:  # argparse: the subcommand's usage, then the error line
            assert err.startswith("usage: rollhpc export") and err.splitlines()[-1] == expected, (
                args,
                err,
            )
        else:
            assert err.startswith(f"rollhpc export: {expected}") and "\n" not in err, (args, err)
    assert not out.exists() and not any((run / "checkpoints").glob(".*partial*"))
    assert [p.name for p in (tmp_path / "exists").iterdir()] == []


def test_export_help_explains_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: rollhpc export [-h] [--step N]")
    for words in (
        "newest good checkpoint, the one a resume would use",
        "--step N",
        "Example: rollhpc export runs/quickstart models/quickstart-final",
        "pipeline.options.export_hf=final writes RUN_DIR/export/hf",
    ):
        assert words in text, words
