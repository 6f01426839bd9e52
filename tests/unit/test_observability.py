"""What a run leaves behind: HDF5 rollouts round trip and atomic writes, TensorBoard scalars, RunLog."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rollhpc import rundir
from rollhpc.observability.metrics import read_metrics
from rollhpc.observability.rollouts import RolloutRecord, read_rollouts, write_rollouts
from rollhpc.observability.run_log import RunLog
from rollhpc.observability.tensorboard import TensorBoardLog


def _ragged_record() -> RolloutRecord:
    return RolloutRecord(
        prompt_tokens=[np.array([5, 6, 7]), np.array([1]), np.array([2, 3])],
        response_tokens=[np.array([9, 8]), np.array([], dtype=np.int64), np.array([4, 4, 4, 4])],
        logprobs=[np.array([-0.5, -1.25]), np.array([]), np.array([-0.1, -0.2, -0.3, -0.4])],
        reward=np.array([1.0, 0.0, 0.5]),
        version=np.array([7, 7, 6]),
        prompt_text=["five six seven", "one", "two three"],
        response_text=["nine eight", "", "four ×4"],
    )


def _fail(*args, **kwargs):
    raise OSError("disk full")


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_rollouts_round_trip_ragged_with_an_empty_response(tmp_path):
    rec = _ragged_record()
    path = write_rollouts(tmp_path / "step_000003.h5", 3, rec)
    got = read_rollouts(path)
    assert got["step"] == 3 and got["time"] > 0
    for key in ("prompt_tokens", "response_tokens", "logprobs"):
        assert len(got[key]) == 3
        for a, b in zip(got[key], getattr(rec, key)):
            np.testing.assert_array_equal(a, np.asarray(b, dtype=a.dtype))
    assert [a.dtype for a in got["prompt_tokens"]] == [np.int32] * 3 and got["logprobs"][
        0
    ].dtype == np.float32
    assert got["response_tokens"][1].shape == (0,)
    np.testing.assert_array_equal(got["reward"], np.float32([1.0, 0.0, 0.5]))
    assert got["version"].dtype == np.int64 and got["version"].tolist() == [7, 7, 6]
    assert got["prompt_text"] == rec.prompt_text and got["response_text"] == rec.response_text


def test_rollouts_fixed_width_arrays_and_no_text(tmp_path):
    prompts = np.arange(8).reshape(4, 2)
    rec = RolloutRecord(
        prompt_tokens=prompts,
        response_tokens=np.arange(4)[:, None],
        logprobs=np.full((4, 1), -0.5),
        reward=np.ones(4),
        version=np.zeros(4),
    )
    got = read_rollouts(write_rollouts(tmp_path / "r.h5", 1, rec))
    assert [p.tolist() for p in got["prompt_tokens"]] == prompts.tolist()
    assert [r.tolist() for r in got["response_tokens"]] == [[0], [1], [2], [3]]
    assert got["prompt_text"] is None and got["response_text"] is None and got["routes"] is None
    # a MoE run's routes: each sample's fed tokens (2-token prompt + 1-token response: 2) x 3 layers x top 2
    rec.routes = [np.full((2, 3, 2), i, dtype=np.int16) for i in range(4)]
    routes = read_rollouts(write_rollouts(tmp_path / "moe.h5", 1, rec))["routes"]
    assert [r.shape for r in routes] == [(2, 3, 2)] * 4 and [int(r[0, 0, 0]) for r in routes] == [
        0,
        1,
        2,
        3,
    ]


def test_rollouts_refuse_mismatched_fields(tmp_path):
    rec = _ragged_record()
    rec.logprobs = [np.array([-0.5]), np.array([]), np.array([-0.1, -0.2, -0.3, -0.4])]
    with pytest.raises(ValueError, match="one value per response token"):
        write_rollouts(tmp_path / "r.h5", 1, rec)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rollout_write_leaves_neither_file_nor_temp(tmp_path, monkeypatch):
    target = tmp_path / "rollouts" / "step_000001.h5"
    monkeypatch.setattr(rundir.os, "replace", _fail)  # fails after the temp file is fully written
    with pytest.raises(OSError, match="disk full"):
        write_rollouts(target, 1, _ragged_record())
    assert not target.exists() and list(target.parent.iterdir()) == []

    import h5py

    monkeypatch.undo()
    monkeypatch.setattr(h5py.File, "create_dataset", _fail)  # fails half way through the temp file
    with pytest.raises(OSError, match="disk full"):
        write_rollouts(target, 1, _ragged_record())
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_a_failed_rewrite_keeps_the_previous_file(tmp_path, monkeypatch):
    target = write_rollouts(tmp_path / "r.h5", 1, _ragged_record())
    monkeypatch.setattr(rundir.os, "replace", _fail)
    with pytest.raises(OSError, match="disk full"):
        write_rollouts(target, 2, _ragged_record())
    assert read_rollouts(target)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["r.h5"]


def test_tensorboard_scalars_read_back_and_non_numbers_skipped(tmp_path):
    tb = TensorBoardLog(tmp_path / "tb")
    tb.add_scalars(
        1, {"reward_mean": 0.25, "loss": np.float32(-1.5), "note": "text", "flag": True, "n": 3}
    )
    tb.add_scalars(2, {"reward_mean": 0.75, "loss": 2.0})
    tb.close()
    assert _scalars(tmp_path / "tb") == {
        "reward_mean": [(1, 0.25), (2, 0.75)],
        "loss": [(1, -1.5), (2, 2.0)],
        "n": [(1, 3.0)],
    }


def test_run_log_writes_metrics_tensorboard_and_rollouts(tmp_path):
    with RunLog(tmp_path) as run_log:
        run_log.log_step(0, {"accuracy": 0.5})
        run_log.log_step(
            1, {"reward_mean": 0.25, "policy_version": 1, "tag": "x"}, _ragged_record()
        )
    records = read_metrics(tmp_path / "metrics.jsonl")
    # wall time, for rollhpc report
    assert all(abs(r.pop("time") - time.time()) < 60 for r in records)
    assert records == [
        {"step": 0, "accuracy": 0.5},
        {"step": 1, "reward_mean": 0.25, "policy_version": 1, "tag": "x"},
    ]
    assert _scalars(tmp_path / "tb") == {
        "accuracy": [(0, 0.5)],
        "reward_mean": [(1, 0.25)],
        "policy_version": [(1, 1.0)],
    }
    assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["step_000001.h5"]
    assert read_rollouts(tmp_path / "rollouts" / "step_000001.h5")["step"] == 1
