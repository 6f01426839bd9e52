"""GeneratorLoads (the rollout scheduler's per-generator request counts) picks what a scan of every generator
picks, the lowest index among the least loaded, through any sequence of changes and exclusions."""

from __future__ import annotations

import random

import pytest

from rollhpc.rollout.generator_loads import GeneratorLoads


def test_least_is_the_scan_s_choice_through_random_changes():
    rng = random.Random(0)
    for n in (1, 2, 7, 64):
        loads, ref = GeneratorLoads(n), [0] * n
        for _ in range(3000):
            excluded = (
                frozenset(rng.sample(range(n), rng.randrange(n)))
                if rng.random() < 0.3
                else frozenset()
            )
            want = min((g for g in range(n) if g not in excluded), key=lambda g: ref[g])
            assert loads.least(excluded) == want
            g = want if rng.random() < 0.6 else rng.randrange(n)
            by = 1 if ref[g] == 0 or rng.random() < 0.55 else -1
            loads.change(g, by)
            ref[g] += by
            assert loads[g] == ref[g] and loads.total == sum(ref)
        assert len(loads._heap) <= 4 * n + 64 + 1  # stale entries are dropped, not kept forever


def test_every_generator_excluded_is_an_error():
    loads = GeneratorLoads(3)
    with pytest.raises(ValueError, match="every generator is excluded"):
        loads.least({0, 1, 2})
    assert loads.least({0}) == 1  # the skipped entries are back
    assert loads.least() == 0
