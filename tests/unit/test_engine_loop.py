"""The generate role's engine loop when its engine fails: the next scheduler call raises the engine's error
instead of waiting for completions that will never come, and a closed loop refuses calls; and while the
engine works on requests it has just taken, calls wait instead of spinning. (The real engine stepping through
the loop is covered by tests/support/rollout_probe.py; neither an engine error nor a slow first step can be provoked
there on demand.)"""

from __future__ import annotations

import time

import pytest

from rollhpc.rollout.ports import GenerationReply, GenerationRequest
from rollhpc.workers.engine_loop import EngineLoop


class BrokenEngine:
    """Takes requests, then fails on its first step, as an engine out of KV cache or with a bad kernel does."""

    def __init__(self) -> None:
        self.live: list[str] = []

    def add_request(self, request_id: str, prompt: list[int], **_: object) -> None:
        self.live.append(request_id)

    def num_unfinished(self) -> int:
        return len(self.live)

    def step(self) -> list:
        raise RuntimeError("kernel failed")

    def abort(self, ids: list[str]) -> list:
        return []


def test_a_failing_engine_fails_the_next_call_and_a_closed_loop_refuses():
    loop = EngineLoop(BrokenEngine(), temperature=1.0, top_p=1.0)
    with pytest.raises(
        RuntimeError, match="the engine loop failed: RuntimeError\\('kernel failed'\\)"
    ):
        loop.call([GenerationRequest("0.0.0", [1, 2], 4)], [], max_wait_s=5.0)
    idle = EngineLoop(BrokenEngine(), temperature=1.0, top_p=1.0)
    assert idle.call([], [], max_wait_s=0.01) == GenerationReply([], [], 0.0)
    idle.close()
    with pytest.raises(RuntimeError, match="has stopped"):
        idle.call([], [], max_wait_s=0.01)


class SlowFirstStepEngine:
    """Its step takes longer than the scheduler waits per call, as vLLM's first step over a whole batch of new
    requests (their prefill) can."""

    def __init__(self) -> None:
        self.live: list[str] = []

    def add_request(self, request_id: str, prompt: list[int], **_: object) -> None:
        self.live.append(request_id)

    def num_unfinished(self) -> int:
        return len(self.live)

    def step(self) -> list:
        time.sleep(0.3)
        done, self.live = [(rid, "completion") for rid in self.live], []
        return done

    def abort(self, ids: list[str]) -> list:
        return []


def test_calls_wait_while_the_engine_steps_requests_it_has_just_taken():
    """Between the loop taking new requests and its step reporting them running, a call must not take the
    engine for idle: it returned at once, the scheduler called again at once, and the spinning calls held the
    GIL the engine's thread needs (measured: a 0.5 s rollout took 2.8 s)."""
    loop = EngineLoop(SlowFirstStepEngine(), temperature=1.0, top_p=1.0)
    finished = loop.call([GenerationRequest("a", [1], 1)], [], max_wait_s=0.02).finished
    calls = 0
    while not finished:
        calls += 1
        assert calls < 100, "calls return at once while the engine works"
        finished = loop.call([], [], max_wait_s=0.02).finished
    assert finished == [("a", "completion")]
    loop.close()
