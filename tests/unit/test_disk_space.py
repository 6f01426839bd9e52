"""Disk space for checkpoints (rollhpc.checkpoint.disk_space): a full filesystem or quota is recognised whatever
library reported it, told in one line with what is intact and what continues, a save that cannot fit is not
started, and a warning comes while only a few more fit."""

from __future__ import annotations

import logging
import shutil
from collections import namedtuple

import pytest

from rollhpc.checkpoint import disk_space
from rollhpc.checkpoint.storage import CheckpointStore

Usage = namedtuple("Usage", "total used free")
MIB = 1 << 20


@pytest.mark.parametrize(
    "err_type, message",
    [
        ("OSError", "[Errno 28] No space left on device: '/scratch/run/ckpt/x.distcp'"),
        ("OSError", "[Errno 122] Disk quota exceeded"),
        (
            "CheckpointException",
            "CheckpointException ranks:dict_keys([0]) ... RuntimeError: Worker failure: [enforce fail at "
            "inline_container.cc:672] . unexpected pos 704 vs 598",
        ),
        ("RuntimeError", "PytorchStreamWriter failed writing file data/3: file write failed"),
    ],
)
def test_a_write_out_of_space_is_recognised_whatever_raised_it(err_type, message):
    assert disk_space.is_disk_full(err_type, message)


def test_other_errors_are_not_out_of_space():
    assert not disk_space.is_disk_full("ValueError", "lr must be positive, got -1.0")
    assert not disk_space.is_disk_full("RuntimeError", "position 28 out of range")


@pytest.fixture
def store(tmp_path):
    """A run directory with one committed checkpoint of 4 MiB (step 2)."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)
    pending = store.begin(2)
    (pending.path / "train").mkdir()
    (pending.path / "train" / "shard.bin").write_bytes(b"\0" * (4 * MIB))
    store.commit(pending, {"step": 2})
    return store


def test_the_line_names_the_filesystem_the_size_what_is_intact_and_the_resume(store, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(12 * MIB, 11 * MIB, 1 * MIB))
    run_dir = store.root.parent
    err = disk_space.out_of_space(store, run_dir, "checkpoint 4")
    line = err.summary
    assert line.startswith(
        f"out of disk space: checkpoint 4 failed: {disk_space.mount_point(run_dir)} has"
    )
    assert "1.0 MiB free of 12.0 MiB" in line
    assert "a checkpoint takes about 4.2 MiB (as step_000002 did)" in line
    assert "the newest good checkpoint, step_000002 (step 2), is intact" in line
    assert f"slurm/resume.sh {run_dir.resolve()}" in line and "--resume" in line
    assert "\n" not in line


def test_a_save_that_cannot_fit_is_not_started_and_a_few_more_warn(store, monkeypatch, caplog):
    run_dir = store.root.parent
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * MIB, 97 * MIB, 3 * MIB))
    with pytest.raises(
        disk_space.OutOfSpace, match="checkpoint 4 was not started, it would not fit"
    ):
        disk_space.check_room(store, run_dir, 4)
    assert store.latest_step() == 2 and not list(store.root.glob("*.tmp*"))
    # room for two more 4.2 MiB checkpoints: saved, with a warning
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * MIB, 91 * MIB, 9 * MIB))
    with caplog.at_level(logging.WARNING, logger="rollhpc.checkpoint"):
        disk_space.check_room(store, run_dir, 4)
    assert "has room for 2 more checkpoint(s) of 4.2 MiB" in caplog.text
    # plenty: silent
    caplog.clear()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * MIB, 10 * MIB, 90 * MIB))
    with caplog.at_level(logging.WARNING, logger="rollhpc.checkpoint"):
        disk_space.check_room(store, run_dir, 4)
    assert caplog.text == ""


def test_the_first_save_has_no_size_to_go_by(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(12 * MIB, 12 * MIB, 0))
    disk_space.check_room(store, tmp_path, 2)  # nothing to compare: the save is tried
    assert (
        "no checkpoint was committed yet" in disk_space.out_of_space(store, tmp_path, "x").summary
    )
