"""rollhpc.proc.startup_gc: no automatic collection while a rank starts, then one collection and a freeze."""

from __future__ import annotations

import gc
import weakref

import pytest

from rollhpc.proc.startup_gc import startup_gc


@pytest.fixture
def unfrozen():
    """Each test leaves the collector as it found it (the freeze would otherwise outlive it)."""
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if was_enabled:
        gc.enable()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_off_inside_then_frozen_and_back_on(unfrozen):
    gc.enable()
    frozen_before = gc.get_freeze_count()
    with startup_gc():
        assert not gc.isenabled()
        kept = [object() for _ in range(10)]
        cycle = weakref.ref(_Cycle())  # garbage only the cyclic collector frees
        gc.collect(0)  # explicit collections still run (vLLM's memory profiler makes some)
        assert cycle() is None
        leftover = weakref.ref(_Cycle())
        kept += [[] for _ in range(5000)]  # enough allocations to start a collection, were it on
        assert leftover() is not None
    assert gc.isenabled()
    assert leftover() is None  # collected on the way out, before the freeze
    # the survivors are out of the collector's generations
    assert gc.get_freeze_count() > frozen_before
    assert kept


def test_left_off_when_it_was_off_and_restored_on_error(unfrozen):
    gc.disable()
    with pytest.raises(RuntimeError):
        with startup_gc():
            raise RuntimeError("construction failed")
    assert not gc.isenabled()
