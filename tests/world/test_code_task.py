"""The pyfunc code task and the code reward role, with real bubblewrap sandboxes: splits are stable and
disjoint, references pass every hidden test, and wrong, malformed or hostile answers score 0 or partly
without crashing or hanging the scorer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rollhpc.parallel import RankCoords
from rollhpc.protocol.worker import WorkerContext
from rollhpc.sandbox import SandboxPool, SandboxUnavailable
from rollhpc.tasks import pyfunc, task_module
from rollhpc.tasks.pyfunc import PyfuncExample, read_response

# x % 5 on hidden inputs 0 4 5 7 9: " x" passes 0 and 4, so partial scores are easy to predict.
MOD5 = PyfuncExample(
    family="mod",
    expression="x%5",
    shown=((1, 1), (3, 3), (6, 1)),
    hidden_inputs=(0, 4, 5, 7, 9),
    hidden_outputs=(0, 4, 0, 2, 4),
)


@pytest.fixture(scope="module")
def pool():
    from rollhpc.sandbox import Sandbox

    try:  # short deadlines: each hostile program below costs at most ~2 s
        sandbox = Sandbox(pyfunc.sandbox_limits(wall_s=2.0, cpu_s=2.0))
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap cannot make a sandbox on this machine: {e}")
    with SandboxPool(sandbox) as p:
        yield p


def scores(pool, examples, texts, **kw) -> list[dict[str, float]]:
    return pyfunc.score_components_batch(examples, texts, pool, **kw)[0]


# ------------------------------------------------------------------ splits
def test_splits_are_deterministic_disjoint_and_stable():
    train, heldout = pyfunc.make_splits(7, n_train=600, n_heldout=100)
    assert (train, heldout) == pyfunc.make_splits(7, n_train=600, n_heldout=100)
    keys = [(e.expression, tuple(x for x, _ in e.shown)) for e in train + heldout]
    assert len(set(keys)) == len(keys)  # the key: the function and the inputs shown
    # held-out set independent of n_train
    assert pyfunc.make_splits(7, n_train=50, n_heldout=100)[1] == heldout
    assert pyfunc.make_splits(8, n_train=600, n_heldout=100)[1] != heldout
    for e in train + heldout:
        shown = [x for x, _ in e.shown]
        assert shown == sorted(shown) and not set(shown) & set(e.hidden_inputs)
        assert len(e.shown) == 3 and len(e.hidden_inputs) == len(e.hidden_outputs) == 5
    assert {e.family for e in train} == set(pyfunc.DEFAULT_OPTIONS["families"])
    # drawn with rng.random() only: the same text on every Python version
    first = pyfunc.make_splits(0, 0, 1)[1][0]
    assert list(pyfunc.corpus([first])) == ["f(2)=2 f(3)=3 f(7)=7 | def f(x): return x%9"]
    assert (first.hidden_inputs, first.hidden_outputs) == ((5, 4, 8, 1, 6), (5, 4, 8, 1, 6))

    train, heldout = pyfunc.make_splits(7, n_train=600, n_heldout=100, disjoint="functions")
    assert not {e.expression for e in train} & {e.expression for e in heldout}
    assert task_module("pyfunc") is pyfunc


def test_functions_have_one_spelling_and_options_are_checked():
    funcs = pyfunc.functions(("linear", "scaled", "reverse"), coef_max=9, x_max=9)
    expressions = [e for _, e, _ in funcs]
    # the same function: first family's spelling
    assert "2*x+2" in expressions and "(x+1)*2" not in expressions
    assert "(x+2)*9" in expressions  # 9*x+18: no linear spelling within coef_max
    assert len({v for _, _, v in funcs}) == len(funcs)
    with pytest.raises(ValueError, match="families must be"):
        pyfunc.make_splits(0, 10, 10, families=("linear", "cubic"))
    with pytest.raises(ValueError, match="n_shown \\+ n_hidden <= x_max \\+ 1"):
        pyfunc.make_splits(0, 10, 10, n_shown=5, n_hidden=6)
    # 10 functions x 2 inputs
    with pytest.raises(
        ValueError, match="found only 20 distinct examples .* .for the held-out split"
    ):
        pyfunc.make_splits(0, 0, 21, families=("square",), n_shown=1, n_hidden=1, x_max=1)
    with pytest.raises(ValueError, match="disjoint must be"):
        pyfunc.make_splits(0, 10, 10, disjoint="prompts")


@pytest.mark.parametrize(
    "text, expression, well_formed",
    [
        (" 2*x+1", "2*x+1", True),
        ("  2 * x + 1  \n", "2 * x + 1", True),
        (
            " 2*x+1\nf(4)=9",
            "2*x+1",
            False,
        ),  # runs the first line; the rest costs the format penalty
        (" 2*x+1 # a comment", "2*x+1 # a comment", True),
        ("", None, False),
        (" return 2*x+1", None, False),
        (" 2*x+", None, False),
        (" import os", None, False),
        (" x; import os", None, False),
        (" (" * 300, None, False),  # too long to parse
        (" x\x00", None, False),
    ],
)
def test_read_response(text, expression, well_formed):
    r = read_response(text)
    assert (r.expression, r.well_formed) == (expression, well_formed)


# ------------------------------------------------------------------ scoring in the sandbox
def test_references_and_equivalent_answers_pass_every_test_in_the_sandbox(pool):
    families = tuple(pyfunc.FAMILIES)
    train, heldout = pyfunc.make_splits(1, 40, 10, families=families)
    examples = train + heldout
    assert {e.family for e in examples} == set(families)
    # the references themselves, run in the sandbox (what the no-run shortcut for them relies on)
    jobs = [pyfunc.harness_source(e.expression, e.hidden_inputs) for e in examples]
    assert [pyfunc.results_passed(e, r) for e, r in zip(examples, pool.map(jobs))] == [1.0] * len(
        examples
    )
    # other spellings of the same function go through the sandbox too
    respelt = [f" ({e.expression})+0" for e in examples]
    assert [c["tests"] for c in scores(pool, examples, respelt)] == [1.0] * len(examples)
    assert pyfunc.score(MOD5, " x%5") == 1.0  # the module's own sandbox
    assert pyfunc.score(MOD5, " x - 5*(x//5)") == 1.0
    assert pyfunc.score_batch([MOD5, MOD5], [" x", " x%5"]) == [0.4, 1.0]


HOSTILE = {  # response -> expected tests fraction on MOD5
    "x": 0.4,  # right on 0 and 4
    "x%5 if x < 7 else 1/0": 0.6,  # an exception fails that input only
    "x%5 if x < 7 else sum(1 for _ in iter(int, 1))": 0.6,  # so does a Python-level infinite loop (its own timer)
    "(lambda: [0 for _ in iter(int, 1)])()": 0.0,  # infinite loop filling memory
    "sum(iter(int, 1))": 0.0,  # infinite loop in C: the whole program's deadline
    "[0] * 10**10": 0.0,  # huge allocation: MemoryError
    "9**9**9": 0.0,  # a huge number computed in C
    "f(x)": 0.0,  # RecursionError
    "exit(0)": 0.0,
    "__import__('os')._exit(0)": 0.0,  # ends the program before it prints: no result line
    "__import__('os').system('kill -9 $PPID')": 0.0,
    "print('RESULT [0, 4, 0, 2, 4]') or -1": 0.0,  # prints go nowhere while the candidate runs
    # a fake result line of the values the prompt shows (all it can know), then an exit
    "__import__('os').write(1, b'RESULT [1, 3, 1, 1, 3]\\n') and __import__('os')._exit(0)": 0.0,
    "x > 0": 0.0,  # booleans are not ints
    "x * 1.0": 0.0,  # nor are floats
    "'\"); import os; print(1); (\"'": 0.0,  # quotes stay inside the string: a str result
    "garbage": 0.0,  # NameError
    "def f(x): return x%5": 0.0,  # not an expression: nothing runs
}


def test_wrong_and_hostile_answers_score_zero_or_partly_and_never_hang(pool, tmp_path):
    victim = tmp_path / "written-from-the-sandbox"
    hostile = {**HOSTILE, f"open({str(victim)!r}, 'w').write('x')": 0.0}
    start = time.perf_counter()
    got = scores(pool, [MOD5] * len(hostile), [" " + t for t in hostile])
    elapsed = time.perf_counter() - start
    assert {t: c["tests"] for t, c in zip(hostile, got)} == hostile
    assert not victim.exists()
    assert elapsed < 20, (
        f"{elapsed:.1f} s for {len(hostile)} programs: something waited past its deadline"
    )


def test_format_component(pool):
    texts = [" x%5", " x%5\n", " x%5\nf(4)=4", "", " def f(x): return x%5", " x"]
    got = scores(pool, [MOD5] * len(texts), texts)
    assert got == [
        {"tests": 1.0, "format": 0.0},
        {"tests": 1.0, "format": 0.0},
        {"tests": 1.0, "format": -0.1},
        {"tests": 0.0, "format": -0.1},
        {"tests": 0.0, "format": -0.1},
        {"tests": 0.4, "format": 0.0},
    ]
    assert pyfunc.score_components(MOD5, " x\nmore", pool, format_penalty=0.25) == {
        "tests": 0.4,
        "format": -0.25,
    }
    assert pyfunc.score(MOD5, " x%5\nmore") == 1.0  # score is the tests fraction alone


def test_no_bwrap_fails_closed(monkeypatch, tmp_path):
    import rollhpc.sandbox.bwrap as bwrap

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(bwrap, "_wheel_bwrap", lambda: None)
    monkeypatch.setattr(pyfunc, "_sandbox", None)
    with pytest.raises(
        SandboxUnavailable,
        match="the pyfunc task runs every answer in a bubblewrap sandbox.*no bwrap",
    ):
        pyfunc.score(MOD5, " x%5")


# ------------------------------------------------------------------ the reward role
def code_worker(tmp_path: Path, model_dir: Path, **options: Any):
    from rollhpc.config import from_dict
    from rollhpc.workers.code_reward import CodeRewardWorker

    ctx = WorkerContext(
        role="reward",
        world_rank=1,
        coords=RankCoords(0, 0, 0, 0, 0, 1, True),
        group_size=1,
        role_comm=None,
        run_dir=tmp_path,
        seed=0,
    )
    opts = from_dict(
        CodeRewardWorker.Options, {"model_dir": str(model_dir), **options}, "roles.reward.options"
    )
    return CodeRewardWorker(ctx, opts)


def test_reward_role_scores_components_and_counts_programs(tiny_model, tmp_path, pool):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)  # byte-level BPE: any text round-trips
    texts = [" x%5", " x", " x%5\nf(4)=4", " sum(iter(int, 1))", " [0] * 10**10", " x+", " (x)%5"]
    items = [
        (MOD5, tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in texts
    ]
    worker = code_worker(tmp_path, tiny_model, wall_s=1.5, cpu_s=1.5, workers=2, format_penalty=0.2)
    try:
        got = worker.score(items)
        metrics = worker.metrics()
    finally:
        worker.close()
    assert got == [
        {"tests": 1.0, "format": 0.0},
        {"tests": 0.4, "format": 0.0},
        {"tests": 1.0, "format": -0.2},
        {"tests": 0.0, "format": 0.0},
        {"tests": 0.0, "format": 0.0},
        {"tests": 0.0, "format": -0.2},
        {"tests": 1.0, "format": 0.0},
    ]
    # " x%5" twice and " x+" need no program; the C loop times out; the others run to the end
    assert {k: v for k, v in metrics.items() if k != "code_wall_s_mean"} == {
        "code_items": 7,
        "code_programs": 3,
        "code_timeouts": 1,
        "code_errors": 0,
    }
    assert 0 < metrics["code_wall_s_mean"] < 1.5


def test_reward_role_options_and_fail_closed(tiny_model, tmp_path, monkeypatch):
    import rollhpc.sandbox.bwrap as bwrap
    from rollhpc.config import ConfigError

    with pytest.raises(
        ConfigError, match="task 'arithmetic' is not a code task: it lacks sandbox_limits"
    ):
        code_worker(tmp_path, tiny_model, task="arithmetic")
    with pytest.raises(ConfigError, match="workers must be >= 1"):
        code_worker(tmp_path, tiny_model, workers=0)
    with pytest.raises(ConfigError, match="SandboxLimits.wall_s must be a positive number"):
        code_worker(tmp_path, tiny_model, wall_s=0)
    with pytest.raises(ConfigError, match="format_penalty must be >= 0"):
        code_worker(tmp_path, tiny_model, format_penalty=-1)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(bwrap, "_wheel_bwrap", lambda: None)
    with pytest.raises(
        SandboxUnavailable,
        match="reward role 'reward' runs the policy's code only in a sandbox, and "
        "none can be made on this node: no bwrap",
    ):
        code_worker(tmp_path, tiny_model)
