"""The sample-level rollout scheduler against a real vLLM engine (tiny random model, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollhpc.rollout.scheduler_config import SchedulerConfig

PROBE = Path(__file__).parents[1] / "support" / "rollout_probe.py"


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    model = create_tiny_model(
        tmp_path_factory.mktemp("m") / "tiny",
        TinyModelConfig(),
        build_tokenizer(list(arithmetic.corpus(train)), 300),
    )
    res = subprocess.run(
        [sys.executable, str(PROBE), str(model)], capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_dynamic_sampling_keeps_only_groups_with_signal(seen):
    a = seen["A"]
    assert a["sizes"] == [4, 4, 4, 4] and all(ix == [0, 1, 2, 3] for ix in a["indices"])
    assert all(uid % 2 == 0 for uid in a["uids"])  # odd prompts always score 0: never kept
    assert all(len(set(r)) > 1 for r in a["rewards"])
    assert a["dropped"] >= 2  # at least the odd prompts among those started
    assert a["lens"] == [6] and a["logprob_lens_ok"] and a["versions"] == [0]
    assert a["unfinished"] == 0


def test_batch_fills_from_short_samples_and_aborts_the_long_tail(seen):
    b = seen["B"]
    assert b["lens"] == [[3, 3], [3, 3]]  # the 40-token prompt did not hold the batch back
    assert b["aborted"] >= 2 and b["unfinished"] == 0


def test_partial_rollout_resumes_under_the_next_version(seen):
    c = seen["C"]
    assert c["partial_lens"] and all(0 < n < 40 for n in c["partial_lens"])
    assert c["second_uids"] == [0] and c["resumed"] == 2
    assert c["resumed_lens"] == [40, 40] and c["resumed_logprobs_ok"]
    # a sample's version is the oldest policy that wrote into it
    assert c["resumed_versions"] == [
        0,
        0,
    ]
    assert c["carried_after"] == 0 and c["unfinished"] == 0


def test_stale_groups_are_dropped(seen):
    assert seen["D"]["stale"] >= 1 and seen["D"]["buffer_left"] == 0


def test_scheduler_config_is_validated():
    with pytest.raises(ValueError, match="group_size"):
        SchedulerConfig(group_size=0)
    with pytest.raises(ValueError, match="max_staleness"):
        SchedulerConfig(max_staleness=-1)


@pytest.mark.parametrize("release_at", [3, None])
def test_held_generators_take_work_only_once_released(release_at):
    """A partial overlap's generators on the trainer's GPUs (held) start only once the pipeline releases them;
    the others fill the batch meanwhile, and alone when the release never comes (scripted generators: the
    engine path is the probe's)."""
    from rollhpc.rollout.ports import Done
    from rollhpc.rollout.collect import HeldGenerators
    from rollhpc.rollout.scheduler import RolloutScheduler
    from rollhpc.rollout.types import Prompt
    from tests.unit.test_agentic_scheduler import ScriptedGenerator

    class Reward:
        def submit(self, items):
            return Done([float(len(resp) % 2) for _, resp in items])

    gens = [ScriptedGenerator([[5, 6, 2]]), ScriptedGenerator([[5, 6, 2]])]
    asked: list[int] = []

    def release() -> bool:
        asked.append(len(gens[0].seen))
        if release_at is not None and len(asked) > release_at:
            assert gens[1].seen == []  # nothing went to the held generator before
            return True
        return False

    cfg = SchedulerConfig(
        group_size=2,
        max_tokens=3,
        dynamic_sampling=False,
        oversample=0.0,
        max_inflight_per_generator=2,
    )
    sched = RolloutScheduler(gens, [Reward()], cfg, seed=0)
    stream = (Prompt(uid, (7, 8), uid) for uid in range(100))
    groups, stats = sched.collect(
        stream, 6, version=0, held=HeldGenerators(frozenset({1}), release)
    )
    assert len(groups) == 6 and all(len(g) == 2 for g in groups)
    assert 0 < stats.generators_held_s <= stats.wall_s
    if release_at is None:
        assert gens[1].seen == [] and len(gens[0].seen) == 12
    else:
        assert len(asked) == release_at + 1 and gens[1].seen  # released, it took part of the batch
    with pytest.raises(ValueError, match="held generators"):
        sched.collect(stream, 1, version=0, held=HeldGenerators(frozenset({2}), release))
