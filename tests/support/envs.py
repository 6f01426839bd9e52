"""Text environments that misbehave on purpose, for the env role's tests (``tests/world/test_env_worker.py``).

One env role hosts one environment class, so ``MixedEnv`` picks a behaviour by the reset seed's hundreds
(``MixedEnv.seed_for("hang")`` is the seed of a hanging episode) and a single batch can mix good episodes
with raising, hanging and garbage-returning ones. Each behaviour is also a class of its own, usable by
name (``tests.support.envs:CountingEnv``).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

FAILS_AT = 1  # the step (1-based) at which a faulty environment misbehaves


class CountingEnv:
    """Works: counts steps, echoes the action, terminates after ``max_steps`` (success if every action was
    ``go``); ``use_tool`` on step 2, a ``chars`` metric per step. With ``marker_dir``, ``close`` leaves a
    file ``closed-<seed>`` there (the env runs in another process: that is how a test sees it closed)."""

    instruction = "Say go."

    def __init__(self, max_steps: int = 3, marker_dir: str | None = None, reward: str = "go"):
        self.max_steps = max_steps
        self.marker_dir = marker_dir
        # "go": 1 for the action "go"; "parity": 1 for an action of odd length (a
        self.reward = reward
        #   random policy earns it half the time: the agentic pipeline's tests need returns that differ)
        self.seed = -1
        self.n = 0
        self.all_go = True

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.seed, self.n, self.all_go = seed, 0, True
        return f"count {seed}", {"instruction": self.instruction, "state_key": ("count", 0)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.n += 1
        self.all_go &= action == "go"
        done = self.n >= self.max_steps
        info = {
            "state_key": ("count", self.n),
            "metrics": {"chars": len(action)},
            "use_tool": self.n == 2,
        }
        if done:
            info["success"] = self.all_go
        reward = float(action == "go") if self.reward == "go" else float(len(action) % 2)
        return f"you said {action!r} at step {self.n}", reward, done, False, info

    def close(self) -> None:
        if self.marker_dir:
            open(os.path.join(self.marker_dir, f"closed-{self.seed}"), "w").close()


class RaisingEnv(CountingEnv):
    """Raises on step ``FAILS_AT``."""

    def step(self, action: str):
        if self.n + 1 >= FAILS_AT:
            raise RuntimeError(f"board exploded at step {self.n + 1}\nsecond line of the message")
        return super().step(action)


class HangingEnv(CountingEnv):
    """Sleeps far past any step limit on step ``FAILS_AT``."""

    def step(self, action: str):
        if self.n + 1 >= FAILS_AT:
            time.sleep(3600)
        return super().step(action)


class RegexHangEnv(CountingEnv):
    """Hangs inside C code that holds the GIL (a catastrophic regular expression) on step ``FAILS_AT``:
    no other thread of its process could run, let alone stop it."""

    def step(self, action: str):
        if self.n + 1 >= FAILS_AT:
            re.match(r"(a+)+$", "a" * 64 + "b")
        return super().step(action)


class GarbageEnv(CountingEnv):
    """Returns something that is not a valid step on step ``FAILS_AT``; which kind by ``seed % 100``."""

    GARBAGE = [
        lambda: ("obs", 1.0, False),  # a 3-tuple
        lambda: (42, 1.0, False, False, {}),  # observation not str
        lambda: ("obs", float("nan"), False, False, {}),  # reward not finite
        lambda: ("obs", 1.0, "no", False, {}),  # terminated not bool
        lambda: ("obs", 1.0, False, False, ["not", "a", "dict"]),  # info not a dict
        lambda: ("obs", 1.0, False, False, {"state_key": ["unhashable"]}),
        lambda: None,
    ]

    def step(self, action: str):
        if self.n + 1 >= FAILS_AT:
            return self.GARBAGE[self.seed % 100 % len(self.GARBAGE)]()
        return super().step(action)


class CrashingEnv(CountingEnv):
    """Its process dies on step ``FAILS_AT`` (as a segfaulting extension would)."""

    def step(self, action: str):
        if self.n + 1 >= FAILS_AT:
            os._exit(7)
        return super().step(action)


class SlowEnv(CountingEnv):
    """Each step takes ``SLOW_S`` (sleeping, so parallel steps overlap even on one CPU)."""

    SLOW_S = 0.3

    def step(self, action: str):
        time.sleep(self.SLOW_S)
        return super().step(action)


class ResetRaisingEnv(CountingEnv):
    def reset(self, seed: int):
        raise ValueError(f"no level for seed {seed}")


class ResetHangingEnv(CountingEnv):
    def reset(self, seed: int):
        time.sleep(3600)


class MixedEnv:
    """Delegates to the behaviour ``BEHAVIOURS[seed // 100]`` (a well-behaved ``CountingEnv`` for seeds past
    them, e.g. the held-out ones); the environment is built at reset."""

    BEHAVIOURS = {
        0: CountingEnv,
        1: RaisingEnv,
        2: HangingEnv,
        3: GarbageEnv,
        4: CrashingEnv,
        5: RegexHangEnv,
        6: SlowEnv,
        7: ResetRaisingEnv,
        8: ResetHangingEnv,
    }

    def __init__(
        self,
        max_steps: int = 3,
        marker_dir: str | None = None,
        reward: str = "go",
        kinds: list[str] | None = None,
    ):
        self.options = {"max_steps": max_steps, "marker_dir": marker_dir, "reward": reward}
        # behaviours by name, chosen by seed % len(kinds) instead of the seed's hundreds
        self.kinds = kinds
        self.inner: CountingEnv | None = None

    @classmethod
    def seed_for(cls, kind: str, k: int = 0) -> int:
        names = {
            "count": 0,
            "raise": 1,
            "hang": 2,
            "garbage": 3,
            "crash": 4,
            "regex": 5,
            "slow": 6,
            "reset_raise": 7,
            "reset_hang": 8,
        }
        return 100 * names[kind] + k

    def reset(self, seed: int):
        if self.kinds:
            kind = self.BEHAVIOURS[self.seed_for(self.kinds[seed % len(self.kinds)]) // 100]
        else:
            # held-out seeds (>= 900): well-behaved
            kind = self.BEHAVIOURS.get(seed // 100, CountingEnv)
        self.inner = kind(**self.options)
        return self.inner.reset(seed)

    def step(self, action: str):
        return self.inner.step(action)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
