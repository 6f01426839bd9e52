"""Reward parts without a model: components and their weights, math-verify scoring (in and out of the
main thread), strict judge verdicts, judge prompts and counters, and the judge role's options."""

from __future__ import annotations

import threading
import time

import pytest

from rollhpc.rewards import combine
from rollhpc.rewards.judge import (
    JudgeCounters,
    check_template,
    judge_fields,
    judge_outputs,
    render_prompt,
)
from rollhpc.rewards.judge_parse import parse_verdict
from rollhpc.rewards.math_verify import score_answer, score_answers, shutdown_pool


def test_combine_is_a_weighted_sum_that_refuses_missing_or_non_finite_parts():
    parts = {"math": 1.0, "judge": 0.5, "format": -1.0}
    # "format" logged only
    assert combine(parts, {"math": 0.8, "judge": 0.2, "format": 0}) == pytest.approx(0.9)
    assert combine(parts, {"judge": 2.0}) == 1.0  # unnamed parts weigh 1
    assert combine({"reward": 0.25}, {}) == 0.25  # one role's reward needs no weights
    with pytest.raises(
        ValueError,
        match="name component\\(s\\) jugde that no reward role returned: the sample has "
        "format, judge, math",
    ):
        combine(parts, {"math": 1.0, "jugde": 1.0})
    with pytest.raises(ValueError, match="must be finite"):
        combine({"math": float("nan")}, {"math": 1.0})


@pytest.mark.parametrize(
    "output, mode, expected",
    [
        ("YES", "yes_no", (1.0, True)),
        ("NO", "yes_no", (0.0, True)),
        ("  YES\n", "yes_no", (1.0, True)),  # surrounding whitespace is allowed
        ("\tNO ", "yes_no", (0.0, True)),
        ("yes", "yes_no", (0.0, False)),  # lower case refused
        ("Yes", "yes_no", (0.0, False)),
        ("YES.", "yes_no", (0.0, False)),
        ("YES NO", "yes_no", (0.0, False)),  # both words
        ("NO YES", "yes_no", (0.0, False)),
        ("The answer is YES", "yes_no", (0.0, False)),  # inside a sentence
        ("YES, the answer is correct", "yes_no", (0.0, False)),
        ("", "yes_no", (0.0, False)),
        ("   ", "yes_no", (0.0, False)),
        ("Y E S", "yes_no", (0.0, False)),
        ("YES\u200b", "yes_no", (0.0, False)),  # zero-width space is not whitespace
        ("Score: 7", "score", (0.7, True)),
        ("Score: 0", "score", (0.0, True)),
        ("Score: 10", "score", (1.0, True)),
        ("\n Score: 3 \n", "score", (0.3, True)),
        ("Score: 11", "score", (0.0, False)),  # out of range
        ("Score: -1", "score", (0.0, False)),
        ("Score: 07", "score", (0.0, False)),  # not canonical
        ("Score: 7 because it is mostly right", "score", (0.0, False)),
        ("Score: 7.5", "score", (0.0, False)),
        ("Score:7", "score", (0.0, False)),
        ("score: 7", "score", (0.0, False)),
        ("Score: 7\nScore: 10", "score", (0.0, False)),
        ("Score: ٧", "score", (0.0, False)),  # non-ASCII digit
        ("Score: " + "9" * 5000, "score", (0.0, False)),
        ("YES", "score", (0.0, False)),  # the other mode's verdict
        ("Score: 10", "yes_no", (0.0, False)),
    ],
)
def test_parse_verdict_accepts_only_the_whole_exact_form(output, mode, expected):
    score, parsed = parse_verdict(output, mode, max_score=10)
    assert (score, parsed) == (pytest.approx(expected[0]), expected[1])


def test_parse_verdict_score_range_and_bad_arguments():
    assert parse_verdict("Score: 3", "score", max_score=4) == (0.75, True)
    assert parse_verdict("Score: 5", "score", max_score=4) == (0.0, False)
    with pytest.raises(ValueError, match="max_score"):
        parse_verdict("Score: 0", "score", max_score=0)
    with pytest.raises(ValueError, match="unknown judge mode"):
        parse_verdict("YES", "binary")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "response, reference",
    [
        ("\\boxed{\\frac{1}{2}}", "1/2"),
        ("\\boxed{0.5}", "1/2"),
        ("The answer is 1/2", "1/2"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),
        ("\\boxed{\\frac12}", "0.5"),
        ("\\boxed{42}", "42"),
        ("The answer is 42", "42"),
        ("\\boxed{42.0}", "42"),
        ("\\boxed{14/16}", "7/8"),
        ("so 3/4 + 1/8 = \\boxed{\\frac{7}{8}}", "7/8"),
        ("\\boxed{-\\frac{3}{4}}", "-3/4"),
        ("\\boxed{-0.75}", "-3/4"),
        ("\\boxed{1\\frac{1}{4}}", "5/4"),
    ],
)
def test_math_verify_accepts_equivalent_forms(response, reference):
    assert score_answer(response, reference) == 1.0
    assert score_answer(response, reference, number_only=True) == 1.0


@pytest.mark.parametrize(
    "response, reference",
    [
        ("\\boxed{41}", "42"),
        ("\\boxed{0.88}", "7/8"),  # close is not equal
        ("\\boxed{1/3}", "1/2"),
        ("\\boxed{3/4}", "-3/4"),
        ("7/8 is wrong, \\boxed{1}", "7/8"),  # the boxed answer wins over earlier numbers
        ("\\boxed{1/2} \\boxed{3}", "1/2"),  # two answers are no answer
        ("", "1/2"),
        ("garbage", "1/2"),
        ("}}}{{{\\boxed{", "1/2"),
        ("\\boxed{" * 500, "1/2"),
        ("\x00\x01 \\frac{", "1/2"),
    ],
)
def test_math_verify_refuses_wrong_answers_and_garbage(response, reference):
    assert score_answer(response, reference) == 0.0


def test_math_verify_number_only_refuses_an_expression_with_the_right_value():
    assert score_answer("\\boxed{3/4 + 1/8}", "7/8") == 1.0  # math-verify compares values
    # a copied question is no answer
    assert score_answer("\\boxed{3/4 + 1/8}", "7/8", number_only=True) == 0.0
    assert score_answer("\\boxed{7/8 + 0}", "7/8", number_only=True) == 0.0
    with pytest.raises(ValueError, match="cannot read the reference"):
        score_answer("\\boxed{1}", "not a number")


def test_math_verify_off_the_main_thread_goes_to_a_process_pool():
    """math-verify's own timeouts raise ValueError outside the main thread; score_answers uses a pool there."""
    from math_verify import parse

    pairs = [
        ("\\boxed{0.5}", "1/2"),
        ("\\boxed{2}", "1/2"),
        ("The answer is 42", "42"),
        ("garbage", "3"),
    ]
    out: dict[str, object] = {}

    def run() -> None:
        try:
            parse("1/2")
        except ValueError as e:
            out["direct"] = str(e)
        t = time.perf_counter()
        out["scores"] = score_answers(pairs, number_only=True)
        out["seconds"] = time.perf_counter() - t

    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(120)
    finally:
        shutdown_pool()
    # the library alone fails here
    assert "doesn't support threaded environment" in str(out["direct"])
    assert out["scores"] == [1.0, 0.0, 1.0, 0.0]
    print(f"pool start + score: {out['seconds']:.2f} s")


def test_math_verify_pool_deadline_scores_zero_instead_of_waiting():
    out: dict[str, object] = {}

    def run() -> None:
        t = time.perf_counter()
        # the pool cannot even start
        out["scores"] = score_answers([("\\boxed{1}", "1")] * 3, pool_deadline_s=0.01)
        out["seconds"] = time.perf_counter() - t
        out["after"] = score_answers([("\\boxed{1}", "1")])  # a fresh pool takes over

    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(120)
    finally:
        shutdown_pool()
    assert out["scores"] == [0.0, 0.0, 0.0] and out["seconds"] < 5
    assert out["after"] == [1.0]


def test_judge_prompt_fills_fields_once_and_leaves_other_braces():
    template = (
        "Q: {question}\nA: {response}\nRef: {reference} (max {max_score}) \\boxed{} {unknown}"
    )
    text = render_prompt(
        template, question="1+1?", response="{reference} {question}", reference="2", max_score=5
    )
    assert text == "Q: 1+1?\nA: {reference} {question}\nRef: 2 (max 5) \\boxed{} {unknown}"
    with pytest.raises(ValueError, match="needs a \\{response\\} field"):
        check_template("Q: {question}")


def test_judge_fields_of_rows_and_task_examples():
    from rollhpc.tasks import arithmetic, freeform_math

    assert judge_fields({"question": "Why?", "reference": "Because."}) == ("Why?", "Because.")
    ex = arithmetic.ArithmeticExample(a=1, op="+", b=2, answer="3")
    assert judge_fields(ex, arithmetic) == ("1 + 2 =", "3")
    fm = freeform_math.FreeformMathExample(a="1/2", op="+", b="1/4", answer="3/4")
    assert judge_fields(fm, freeform_math) == (
        "What is 1/2 + 1/4? Put the answer in \\boxed{}.",
        "3/4",
    )


def test_judge_outputs_counts_unparsed_and_failed():
    counters = JudgeCounters()
    scores = judge_outputs(["YES", " NO\n", "yes", None, "Score: 3"], "yes_no", 10, counters)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert counters.as_dict() == {"judge_calls": 5, "judge_unparsed": 2, "judge_failures": 1}
    judge_outputs(["Score: 3"], "score", 10, counters)
    assert counters.as_dict() == {"judge_calls": 6, "judge_unparsed": 2, "judge_failures": 1}


def test_judge_options_are_checked_at_load(tiny_model, tmp_path):
    from rollhpc.config import ConfigError, from_dict
    from rollhpc.workers.judge import JudgeWorker

    def load(**options):
        return from_dict(
            JudgeWorker.Options,
            {"policy_model_dir": str(tiny_model), **options},
            "roles.judge.options",
        )

    with pytest.raises(
        ConfigError,
        match=f"roles.judge.options: judge_model_dir {tmp_path / 'nope'}: not a Hugging "
        "Face model directory \\(no config.json there\\)",
    ):
        load(judge_model_dir=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="exactly one of judge_model_dir .* and endpoint"):
        load()
    with pytest.raises(ConfigError, match="exactly one of"):
        load(judge_model_dir=str(tiny_model), endpoint="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="http\\(s\\):// URL"):
        load(endpoint="127.0.0.1:8000")
    with pytest.raises(ConfigError, match="needs a \\{response\\} field"):
        load(endpoint="http://127.0.0.1:1", template="Is it right?")
    with pytest.raises(ConfigError, match="is not one of \\['yes_no', 'score'\\]"):
        load(endpoint="http://127.0.0.1:1", mode="binary")
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        load(endpoint="http://127.0.0.1:1", task="nope")
    score_mode = load(judge_model_dir=str(tiny_model), mode="score", max_score=5)
    assert "Score: N" in score_mode.template and "{response}" in score_mode.template
    assert "YES or NO" in load(endpoint="http://127.0.0.1:1").template


def test_judge_prompt_uses_the_judge_chat_template_when_it_has_one(tiny_model):
    from transformers import AutoTokenizer

    from rollhpc.workers.judge import encode_judge_prompt

    tok = AutoTokenizer.from_pretrained(tiny_model)
    # no template: plain text
    assert tok.decode(encode_judge_prompt(tok, "Is 1 + 1 = 2?")) == "Is 1 + 1 = 2?"
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert (
        tok.decode(encode_judge_prompt(tok, "Is 1 + 1 = 2?")) == "<user>Is 1 + 1 = 2?</><assistant>"
    )
