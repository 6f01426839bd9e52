"""The shared run loop's time limits, on a clock the test advances: a step takes 1 s, an evaluation 10 s.

max_wall_s counts everything; max_train_s leaves evaluations out, so a run evaluated every step still trains
its full budget (the benchmark against TRL relies on it: each side's evaluations are off its clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollhpc.checkpoint.run_checkpoint import CheckpointOptions, RunCheckpointer
from rollhpc.controller.run_loop import LoopSettings, Outcome, RunLoop, StepReport


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


@pytest.mark.parametrize("limit, steps_taken", [({"max_wall_s": 15.0}, 3), ({"max_train_s": 3.5}, 4)])
def test_time_limits(tmp_path: Path, limit: dict, steps_taken: int) -> None:
    clock = Clock()
    checkpointer = RunCheckpointer(tmp_path, {}, CheckpointOptions(at_end=False))
    loop = RunLoop(tmp_path, checkpointer, LoopSettings(steps=100, eval_every=1, rollout_every=0, **limit), clock)
    assert loop.run(TimedSteps(clock)) is Outcome.WALL_LIMIT
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps_taken + 1))  # step 0 is the first evaluation
    assert all(r["eval_s"] == 10.0 and r["step_s"] == 11.0 for r in records[1:])
