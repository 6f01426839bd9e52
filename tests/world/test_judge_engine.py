"""The judge role with its own in-process vLLM engine (CPU): decode with the policy's tokenizer, render
with the judge's, generate greedily in one engine call, parse strictly, count.

The judge is tests/support/judge_models.py's: it says " YES" after any prompt in its template's form and writes
no verdict for other text, so both the parsed and the unparsed paths run on one engine. One subprocess
(tests/support/judge_engine_probe.py) starts the engine once and runs every check.
"""

from __future__ import annotations

import json

import pytest

from tests.support.processes import run_probe
from tests.support.judge_models import TEMPLATE, yes_judge

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def probe(tiny_model, tmp_path_factory) -> dict:
    judge_dir = yes_judge(tmp_path_factory.getbasetemp(), tiny_model)
    work = tmp_path_factory.mktemp("judge_engine")
    res = run_probe(
        "judge_engine_probe.py",
        {"policy_dir": str(tiny_model), "judge_dir": str(judge_dir), "template": TEMPLATE},
        work,
    )
    print(json.dumps({k: round(res[k], 3) for k in ("start_s", "batch_s")}))
    return res


def test_judge_engine_scores_a_batch_and_counts(probe):
    assert probe["scores"] == [1.0] * 12  # every prompt in the template's form: " YES"
    assert probe["components"] == [{"judge": 1.0}, {"judge": 1.0}]
    assert probe["metrics"] == {"judge_calls": 14, "judge_unparsed": 0, "judge_failures": 0}


def test_a_prompt_longer_than_the_engine_allows_is_a_counted_failure(probe):
    assert probe["with_too_long"] == [0.0, 1.0]  # the other item of the batch is still judged
    assert probe["metrics_after_too_long"] == {
        "judge_calls": 16,
        "judge_unparsed": 0,
        "judge_failures": 1,
    }


def test_outputs_that_are_no_verdict_are_unparsed(probe):
    assert [o.strip() for o in probe["outputs"]] == ["YES"] * 3
    assert probe["score_mode"] == [0.0] * 3  # "YES" is not "Score: N"
    assert probe["score_mode_counters"] == {
        "judge_calls": 3,
        "judge_unparsed": 3,
        "judge_failures": 0,
    }
    assert probe["off_template"][0].strip() not in ("YES", "NO")
