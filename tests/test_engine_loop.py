"""The generate role's engine loop when its engine fails: the next scheduler call raises the engine's error
instead of waiting for completions that will never come, and a closed loop refuses calls. (The real engine
stepping through the loop is covered by tests/rollout_probe.py; an engine error cannot be provoked there.)"""

from __future__ import annotations

import pytest

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


def test_a_failing_engine_fails_the_next_call_and_a_closed_loop_refuses_calls():
    loop = EngineLoop(BrokenEngine(), temperature=1.0, top_p=1.0)
    with pytest.raises(RuntimeError, match="the engine loop failed: RuntimeError\\('kernel failed'\\)"):
        loop.call([{"id": "0.0.0", "prompt": [1, 2], "max_tokens": 4}], [], max_wait_s=5.0)
    idle = EngineLoop(BrokenEngine(), temperature=1.0, top_p=1.0)
    assert idle.call([], [], max_wait_s=0.01) == {"finished": [], "aborted": [], "busy_s": 0.0}
    idle.close()
    with pytest.raises(RuntimeError, match="has stopped"):
        idle.call([], [], max_wait_s=0.01)
