"""The shared run loop's time limits, on a clock the test advances: a step takes 1 s, an evaluation 10 s.

max_wall_s counts everything; max_train_s leaves evaluations out, so a run evaluated every step still trains
its full budget (the benchmark against TRL relies on it: each side's evaluations are off its clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollhpc.checkpoint.run_checkpoint import CheckpointConfig, RunCheckpointer
from rollhpc.controller.run_loop import LoopConfig, Outcome, RunLoop, StepReport


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedSteps:
    """A pipeline whose steps and evaluations only advance the clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def state_objects(self) -> dict:
        return {}

    def begin(self, resumed: bool) -> None:
        pass

    def step(self, step: int, last: bool) -> StepReport:
        self.clock.now += 1.0
        return StepReport({"reward_mean": 0.0})

    def evaluate(self) -> dict[str, float]:
        self.clock.now += 10.0
        return {"accuracy": 0.5}

    def weights_digest(self) -> str:
        return "0" * 64

    def checkpoint_summary(self) -> dict:
        return {}


@pytest.mark.parametrize(
    "limit, steps_taken", [({"max_wall_s": 15.0}, 3), ({"max_train_s": 3.5}, 4)]
)
def test_time_limits(tmp_path: Path, limit: dict, steps_taken: int) -> None:
    clock = Clock()
    checkpointer = RunCheckpointer(tmp_path, {}, CheckpointConfig(at_end=False))
    loop = RunLoop(
        tmp_path, checkpointer, LoopConfig(steps=100, eval_every=1, rollout_every=0, **limit), clock
    )
    assert loop.run(TimedSteps(clock)) is Outcome.WALL_LIMIT
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # step 0 is the first evaluation
    assert [r["step"] for r in records] == list(range(steps_taken + 1))
    assert all(r["eval_s"] == 10.0 and r["step_s"] == 11.0 for r in records[1:])
    # the training clock max_train_s reads: a second per step, the evaluations' ten left out
    assert [r["train_clock_s"] for r in records[1:]] == [
        float(k) for k in range(1, steps_taken + 1)
    ]


def test_the_console_gives_seconds_per_step_elapsed_time_and_eta(tmp_path: Path, caplog) -> None:
    """Each step's line: this step's seconds, the session's elapsed time and the time left at its pace; the
    held-out accuracy only on the steps that evaluated (every 2nd here), not the last value repeated."""
    clock = Clock()

    class Summarised(TimedSteps):
        def step(self, step: int, last: bool) -> StepReport:
            super().step(step, last)
            return StepReport({"reward_mean": 0.0}, summary="reward 0.00")

    loop = RunLoop(
        tmp_path,
        RunCheckpointer(tmp_path, {}, CheckpointConfig(at_end=False)),
        LoopConfig(steps=4, eval_every=2, rollout_every=0),
        clock,
    )
    with caplog.at_level("INFO", logger="rollhpc"):
        assert loop.run(Summarised(clock)) is Outcome.FINISHED
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("step ") and "/4" in r.getMessage()
    ]
    assert lines == [
        "step 1/4: reward 0.00; 1.0 s/step, 0:01 elapsed, ETA 0:03",
        "step 2/4: reward 0.00, held-out accuracy 0.500; 11.0 s/step, 0:12 elapsed, ETA 0:12",
        "step 3/4: reward 0.00; 1.0 s/step, 0:13 elapsed, ETA 0:04",
        "step 4/4: reward 0.00, held-out accuracy 0.500; 11.0 s/step, 0:24 elapsed",
    ]


def test_a_restart_before_the_first_checkpoint_starts_the_logs_over(tmp_path: Path) -> None:
    """A session lost before its first checkpoint (the chaos benchmark's batch node dying at step 2) leaves
    metrics lines and no checkpoint: the next session starts again from step 0, so what the lost one logged is
    dropped (every step logged once), and restarts.jsonl and step 1 say it was a restart."""
    from rollhpc.rundir.records import read_events

    class Lost(TimedSteps):
        def step(self, step: int, last: bool) -> StepReport:
            if step == 3:
                raise RuntimeError("the node is gone")
            return super().step(step, last)

    def loop() -> RunLoop:
        checkpointer = RunCheckpointer(tmp_path, {}, CheckpointConfig(every=5, at_end=False))
        return RunLoop(
            tmp_path, checkpointer, LoopConfig(steps=4, eval_every=0, rollout_every=0), Clock()
        )

    with pytest.raises(RuntimeError, match="the node is gone"):
        loop().run(Lost(Clock()))
    assert [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [0, 1, 2]
    assert loop().run(TimedSteps(Clock())) is Outcome.FINISHED
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[1]["restarts"] == 1 and all("restarts" not in r for r in records[2:])
    (resume,) = [e for e in read_events(tmp_path) if e["event"] == "resume"]
    assert resume["checkpoint"] is None and resume["step"] == 0 and resume["restarts"] == 1, resume
