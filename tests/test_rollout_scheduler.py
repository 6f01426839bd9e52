"""The sample-level rollout scheduler against a real vLLM engine (tiny random model, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollhpc.rollout.scheduler import SchedulerConfig

PROBE = Path(__file__).with_name("rollout_probe.py")


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    from rollhpc.models.tiny import TinyModelSpec, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    model = create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinyModelSpec(),
                              build_tokenizer(list(arithmetic.corpus(train)), 300))
    res = subprocess.run([sys.executable, str(PROBE), str(model)], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


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
    assert c["resumed_versions"] == [0, 0]  # a sample's version is the oldest policy that wrote into it
    assert c["carried_after"] == 0 and c["unfinished"] == 0


def test_stale_groups_are_dropped(seen):
    assert seen["D"]["stale"] >= 1 and seen["D"]["buffer_left"] == 0


def test_scheduler_config_is_validated():
    with pytest.raises(ValueError, match="group_size"):
        SchedulerConfig(group_size=0)
    with pytest.raises(ValueError, match="max_staleness"):
        SchedulerConfig(max_staleness=-1)
