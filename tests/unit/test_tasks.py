"""Synthetic verifiable tasks: splits are deterministic and disjoint, answers are extracted
robustly, and the rule-based rewards pay only for correct answers (adversarial ones included)."""

from __future__ import annotations

import pytest

from rollhpc.tasks import arithmetic, countdown
from rollhpc.tasks.arithmetic import ArithmeticExample
from rollhpc.tasks.countdown import CountdownExample


@pytest.mark.parametrize(
    "task, key",
    [
        (arithmetic, lambda e: (e.a, e.op, e.b)),
        (countdown, lambda e: (tuple(sorted(e.numbers)), e.target)),
    ],
)
def test_splits_are_deterministic_disjoint_and_solved_by_their_references(task, key):
    train, heldout = task.make_splits(7, n_train=500, n_heldout=100)
    assert (train, heldout) == task.make_splits(7, n_train=500, n_heldout=100)
    assert (len(train), len(heldout)) == (500, 100)
    keys = [key(e) for e in train + heldout]
    assert len(set(keys)) == len(keys)  # unique within and across splits
    # held-out set independent of n_train
    assert task.make_splits(7, n_train=50, n_heldout=100)[1] == heldout
    assert task.make_splits(8, n_train=500, n_heldout=100)[1] != heldout
    texts = list(task.corpus(train[:50]))
    assert all(text.startswith(e.prompt) for text, e in zip(texts, train))
    assert all(task.score(e, task.completion(e)) == 1.0 for e in train + heldout)


def test_arithmetic_options_and_exhausted_space():
    train, heldout = arithmetic.make_splits(0, 300, 50, digits=2, ops=("*",))
    assert all(
        e.op == "*" and e.a < 100 and e.b < 100 and e.answer == str(e.a * e.b)
        for e in train + heldout
    )
    assert all(int(e.answer) >= 0 for e in arithmetic.make_splits(0, 300, 0, ops=("-",))[0])
    assert any(
        int(e.answer) < 0
        for e in arithmetic.make_splits(0, 300, 0, ops=("-",), allow_negative=True)[0]
    )
    # 100 sums + 55 differences a >= b
    with pytest.raises(ValueError, match="found only 155 distinct examples"):
        arithmetic.make_splits(0, 250, 0, digits=1)
    with pytest.raises(ValueError, match="ops must be"):
        arithmetic.make_splits(0, 10, 10, ops=("**",))
    assert (
        arithmetic.format_prompt(ArithmeticExample(a=12, op="+", b=30, answer="42")) == "12 + 30 ="
    )


@pytest.mark.parametrize(
    "response, expected",
    [
        (" 579", "579"),
        ("579", "579"),
        ("   579  \n", "579"),
        ("123 + 456 = 579", "579"),  # restates the problem
        ("Answer: 579.", "579"),
        ("I think 12, no wait... = 579", "579"),  # final number after the marker
        ("Answer: 100 then 579", "579"),
        (" 0579", "579"),
        (" -12", "-12"),
        ("=-0", "0"),
        (" 5-3", "3"),  # a minus after a digit is an operator, not a sign
        ("", None),
        (" the answer is unknown", None),
        ("579 =", None),  # nothing after the last marker
        (" ٥٧٩", None),  # non-ASCII digits are not accepted
        (" " + "9" * 10_000, "9" * 10_000),  # huge numbers compare as text, never overflow int()
    ],
)
def test_arithmetic_extract_answer(response, expected):
    assert arithmetic.extract_answer(response) == expected


def test_arithmetic_score():
    ex = ArithmeticExample(a=123, op="+", b=456, answer="579")
    assert [
        arithmetic.score(ex, r)
        for r in (
            " 579",
            "123 + 456 = 579",
            " 578",
            " 5 7 9",
            " 579 = 580",
            " 57",
            "",
            " -579",
            " 1" + "0" * 5000,
        )
    ] == [1, 1, 0, 0, 0, 0, 0, 0, 0]
    negative = ArithmeticExample(a=3, op="-", b=15, answer="-12")
    assert arithmetic.score(negative, " -12") == 1.0 and arithmetic.score(negative, " 12") == 0.0


def test_arithmetic_show_work_writes_the_column_sums_before_the_answer():
    assert arithmetic.column_sums(4821, 3957) == "1+7=8 2+5=7 8+9=17 4+3+1=8"
    assert (
        arithmetic.column_sums(95, 7) == "5+7=12 9+0+1=10 0+0+1=1"
        and arithmetic.column_sums(0, 0) == "0+0=0"
    )
    train, heldout = arithmetic.make_splits(0, 50, 10, digits=4, ops=("+",), show_work=True)
    plain, _ = arithmetic.make_splits(0, 50, 10, digits=4, ops=("+",))
    # the same problems, longer answers
    assert [(e.a, e.b) for e in train] == [(e.a, e.b) for e in plain]
    ex = train[0]
    text = arithmetic.completion(ex)
    assert (
        text == f" {arithmetic.column_sums(ex.a, ex.b)} Answer: {ex.answer}"
        and arithmetic.score(ex, text) == 1.0
    )
    # the answer counts,
    assert arithmetic.score(ex, text.replace(f"Answer: {ex.answer}", "Answer: 1")) == 0.0
    assert arithmetic.score(ex, f" 1+1=2 Answer: {ex.answer}") == 1.0  # not the work
    with pytest.raises(
        ValueError, match=r"show_work writes column sums of additions: set ops to \['\+'\]"
    ):
        arithmetic.make_splits(0, 5, 5, ops=("+", "-"), show_work=True)


@pytest.mark.parametrize(
    "response, expected",
    [
        (" (50 - 25) + 3 * 7", "(50 - 25) + 3 * 7"),
        ("Answer: 25+3*7", "25+3*7"),
        (" 25 + 3 * 7 = 46", "25 + 3 * 7"),  # a trailing "= target" is dropped
        (" 46 = 25 + 3 * 7", "25 + 3 * 7"),
        (" 25 × 3 ÷ 5", "25 * 3 / 5"),
        (" 25 + 21\nthen some rambling = 3", "25 + 21"),  # first line only
        ("Answer: 7 + 3.", "7 + 3"),
        (" 46", "46"),
        ("", None),
        ("Answer:   \n", None),
    ],
)
def test_countdown_extract_answer(response, expected):
    assert countdown.extract_answer(response) == expected


EX = CountdownExample(numbers=(3, 7, 25, 50), target=46, solution="25 + 3 * 7")


@pytest.mark.parametrize(
    "response, reward",
    [
        (" 25 + 3 * 7", 1.0),
        (" 3*7+25", 1.0),
        (" (50 - 25) + 3 * 7", 1.0),  # every given number once
        (" 50 - (25 - 3 * 7)", 1.0),  # 50 - 4 = 46
        ("Answer: 50 - 7 + 3", 1.0),
        (" ((25)) + (3 * 7) = 46", 1.0),
        (" 50 / 25 * 23", 0.0),  # 23 is not a given number
        (" 25 + 25 - 7 + 3", 0.0),  # 25 reused
        (" 7 * 7 - 3", 0.0),  # 7 reused
        (" 46", 0.0),  # the target itself is not a given number
        (" 50 - 7 / 0", 0.0),  # division by zero
        (" 50 / (7 - 7)", 0.0),
        (" 50 - 25 / 7 * 3", 0.0),  # not an integer, target is one
        (" 50 - 3 - 7 / 7", 0.0),  # reuses 7
        (" 50 - 4", 0.0),  # 4 not given
        (" 50 // 25 + 44", 0.0),  # floor division refused
        (" 3 ** 7", 0.0),  # power refused
        (" -3 + 50 - 7 + 6", 0.0),  # unary minus refused (and 6 not given)
        (" 25.0 + 21", 0.0),  # floats refused
        (" 0x19 + 3 * 7", 0.0),  # hex literal for 25 refused
        (" 2_5 + 3 * 7", 0.0),  # underscore literal refused
        (" __import__('os').system('true')", 0.0),  # names and calls never run
        (" abs(25) + 3 * 7", 0.0),
        (" [25][0] + 3 * 7", 0.0),
        (" 25 + 3 * 7 if 1 else 0", 0.0),
        (" 25 + (3 * 7", 0.0),  # syntax error
        (" " + "(" * 150 + "46" + ")" * 150, 0.0),  # too long
        (" 46 - 0", 0.0),
        ("", 0.0),
    ],
)
def test_countdown_score(response, reward):
    assert countdown.score(EX, response) == reward


def test_countdown_adds_fractions_exactly_and_allows_repeated_numbers():
    twice = CountdownExample(numbers=(5, 5, 2), target=20, solution="(5 + 5) * 2")
    assert countdown.score(twice, " (5 + 5) * 2") == 1.0
    assert countdown.score(twice, " 5 * 5 - 5") == 0.0  # only two fives given
    thirds = CountdownExample(numbers=(1, 3, 9), target=27, solution="9 / (1 / 3)")
    # exact rational arithmetic, no float error
    assert countdown.score(thirds, " 9 / (1 / 3)") == 1.0
    assert countdown.evaluate("7 / 2") == (countdown.Fraction(7, 2), [7, 2])


def test_countdown_generation_options():
    train, heldout = countdown.make_splits(1, 200, 20, num_numbers=3, max_number=10, max_target=30)
    for e in train + heldout:
        assert len(e.numbers) == 3 and all(1 <= n <= 10 for n in e.numbers)
        assert 1 <= e.target <= 30 and e.target not in e.numbers
    assert countdown.format_prompt(EX) == "Numbers: 3 7 25 50\nTarget: 46\nAnswer:"
    with pytest.raises(ValueError, match="num_numbers must be >= 2"):
        countdown.make_splits(0, 1, 1, num_numbers=1)


def test_freeform_math_splits_prompts_and_references():
    import operator
    from fractions import Fraction

    from rollhpc.tasks import freeform_math as fm

    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    train, heldout = fm.make_splits(7, n_train=100, n_heldout=20)
    assert (train, heldout) == fm.make_splits(7, n_train=100, n_heldout=20)
    assert fm.make_splits(7, n_train=10, n_heldout=20)[1] == heldout
    keys = [(e.a, e.op, e.b) for e in train + heldout]
    assert len(set(keys)) == len(keys)
    for e in train + heldout:  # the reference is the exact value, reduced
        value = ops[e.op](Fraction(e.a), Fraction(e.b))
        assert (
            Fraction(e.answer) == value
            and e.answer == fm.written(value, as_decimal=False)
            and value >= 0
        )
        assert all(Fraction(x).denominator <= 9 or "." in x for x in (e.a, e.b))
    assert any("." in e.a + e.b for e in train) and any("/" in e.answer for e in train)
    assert all(fm.score(e, fm.completion(e)) == 1.0 for e in train[:30] + heldout)
    ex = fm.FreeformMathExample(a="3/4", op="+", b="1/8", answer="7/8")
    assert fm.format_prompt(ex) == "What is 3/4 + 1/8? Put the answer in \\boxed{}."
    assert list(fm.corpus([ex])) == ["What is 3/4 + 1/8? Put the answer in \\boxed{}. \\boxed{7/8}"]
    assert (
        fm.written(Fraction(9, 8), as_decimal=True) == "1.125"
        and fm.written(Fraction(1, 3), True) == "1/3"
    )
    assert fm.written(Fraction(-3, 4), as_decimal=True) == "-0.75"
    with pytest.raises(ValueError, match="ops must be"):
        fm.make_splits(0, 1, 1, ops=("/",))


@pytest.mark.parametrize(
    "response, reward",
    [
        (" \\boxed{7/8}", 1.0),
        (" \\boxed{\\frac{7}{8}}", 1.0),
        (" \\boxed{0.875}", 1.0),
        (" \\boxed{14/16}", 1.0),
        (" 3/4 + 1/8 = 6/8 + 1/8 = \\boxed{7/8}", 1.0),
        (" The answer is 7/8", 1.0),  # no box: the last number
        (" \\boxed{3/4 + 1/8}", 0.0),  # the question copied into the box: right value, no answer
        (" \\boxed{7/8 + 0}", 0.0),
        (" \\boxed{0.87}", 0.0),
        (" \\boxed{7/8} \\boxed{1}", 0.0),
        (" \\boxed{}", 0.0),
        ("", 0.0),
    ],
)
def test_freeform_math_score(response, reward):
    from rollhpc.tasks import freeform_math as fm

    assert (
        fm.score(fm.FreeformMathExample(a="3/4", op="+", b="1/8", answer="7/8"), response) == reward
    )


def test_task_module_finds_tasks_by_short_name_or_import_path():
    import rollhpc.tasks as tasks

    assert (
        tasks.task_module("arithmetic") is arithmetic
        and tasks.task_module("countdown") is countdown
    )
    assert (
        tasks.task_module("rollhpc.tasks.freeform_math").__name__ == "rollhpc.tasks.freeform_math"
    )
    assert {"arithmetic", "countdown", "freeform_math"} <= set(tasks.available_tasks())
    assert "modsum" not in tasks.available_tasks()  # a helper module, not a task
    assert tasks.TASKS == tuple(tasks.available_tasks())
    with pytest.raises(
        ValueError,
        match="unknown task 'nope'; tasks in rollhpc.tasks are arithmetic, countdown, "
        "files, freeform_math",
    ):
        tasks.task_module("nope")
    with pytest.raises(ValueError, match="unknown task 'no_such_pkg.task'"):
        tasks.task_module("no_such_pkg.task")
    with pytest.raises(
        ValueError, match="rollhpc.tasks.modsum is not a task module: it lacks make_splits"
    ):
        tasks.task_module("modsum")
    with pytest.raises(ValueError, match="neither a module of rollhpc.tasks nor an import path"):
        tasks.task_module("../arithmetic")


def test_task_module_by_import_path_outside_the_package(tmp_path, monkeypatch):
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "__init__.py").write_text("")
    (tmp_path / "my_tasks" / "echo.py").write_text(
        "def make_splits(seed, n_train, n_heldout): return [], []\n"
        "def format_prompt(e): return e\ndef completion(e): return e\n"
        "def score(e, r): return float(e == r)\ndef corpus(es): return iter(es)\n"
    )
    (tmp_path / "my_tasks" / "broken.py").write_text("import not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from rollhpc.tasks import task_module

    assert task_module("my_tasks.echo").score("a", "a") == 1.0
    # not reported as an unknown task
    with pytest.raises(ModuleNotFoundError, match="not_installed_dependency"):
        task_module("my_tasks.broken")


def test_letters_puzzles_are_disjoint_stable_and_scored_exactly():
    from rollhpc.tasks import letters, task_module

    train, heldout = letters.make_splits(3, 300, 50)
    assert not {(e.op, e.letters) for e in train} & {(e.op, e.letters) for e in heldout}
    assert letters.make_splits(3, 300, 50) == (train, heldout)
    ex = letters.LettersExample("reverse", ("c", "a", "t"), "t a c")
    assert ex.prompt == "reverse: c a t =" and letters.score(ex, letters.completion(ex)) == 1.0
    assert letters.score(ex, "  t a  c ") == 1.0 and letters.score(ex, "tac") == 0.0
    assert letters.score(ex, " t a c a") == 0.0 and letters.score(ex, "") == 0.0
    assert letters.sample(
        __import__("random").Random(0), 4, 4, "ab", ("sort",)
    ).answer.split() == sorted(
        letters.sample(__import__("random").Random(0), 4, 4, "ab", ("sort",)).letters
    )
    assert task_module("letters") is letters
    with pytest.raises(ValueError, match="ops must be"):
        letters.make_splits(0, 1, 1, ops=("shout",))
