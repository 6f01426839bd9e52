"""Python functions from input/output examples: ``f(1)=3 f(2)=5 f(4)=9 | def f(x): return`` -> `` 2*x+1``.

A code-generation task small enough for the tiny policy: the answer is one Python expression in ``x``,
and the reward is the fraction of hidden test inputs (never shown in the prompt) on which it returns the
right value. The functions come from a few families (``FAMILIES``: a*x+b, x*x+b, (x+a)*b, x%m, max/min
with a constant, b-x) with small constants and inputs in [0, x_max], so every value is a number of at
most two or three digits, which the tokenizer keeps digit by digit.

Splits. Functions are compared by what they compute on [0, x_max], not by spelling: "(x+1)*2" and
"2*x+2" are one function, spelt the first way its family order gives (so a reference is unique). An
example is a function plus the inputs shown in the prompt; its key is (function, shown inputs).
``disjoint="examples"`` (the default) keeps those keys apart: a held-out example may show a function
that training showed with other inputs (the model must recognise the function from new evidence).
``disjoint="functions"`` holds out whole functions (a seeded quarter of them): a held-out function
never appears in training in any spelling. Held-out examples are drawn first, so they do not depend on
``n_train``; draws use ``rng.random()`` only (``arithmetic.randint``), so splits are the same everywhere.

Scoring never runs the model's output in this process: the response's first line is checked with
``ast.parse`` (parsing only), then one sandboxed program per sample (``rollhpc.sandbox``, bubblewrap)
evaluates it on every hidden input and prints its results as one JSON line, which is compared here
with the expected values. The expected values never enter the sandbox, so printing instead of
computing gains nothing. Inside, the response becomes the return value of ``def f(x)`` by syntax
tree (no string splicing, so it cannot break out of the harness), each input runs under its own timer
and a failure (exception, timeout, a non-int result) fails that input only. Two shortcuts skip the
sandbox, both exact: a first line that is not one Python expression passes no test, and a response
whose syntax tree equals the reference's is the reference, which passes every test (tests/
test_code_task.py runs the references in the sandbox to check it).

Reward components (``score_components``): ``tests`` (fraction passed) and ``format`` (0 when the
response is exactly one line holding one expression, else ``-format_penalty``). ``score`` is the tests
fraction alone (what the SFT evaluation averages).
"""

from __future__ import annotations

import ast
import inspect
import json
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from rollhpc.sandbox import Sandbox, SandboxLimits, SandboxPool, SandboxResult, SandboxUnavailable
from rollhpc.tasks.arithmetic import randint, unique_stream

__all__ = [
    "DEFAULT_OPTIONS",
    "FAMILIES",
    "FORMAT_PENALTY",
    "PyfuncExample",
    "Response",
    "completion",
    "corpus",
    "format_prompt",
    "functions",
    "harness_source",
    "known_tests",
    "make_splits",
    "read_response",
    "results_passed",
    "sandbox",
    "sandbox_limits",
    "score",
    "score_batch",
    "score_components",
    "score_components_batch",
]

MARKER = "| def f(x): return"
# a longer first line is not an answer (bounds parsing and the program's size)
MAX_EXPRESSION_CHARS = 200
RESULT_PREFIX = "RESULT "
PER_INPUT_S = 0.5  # each hidden input's own timer inside the sandbox
FORMAT_PENALTY = 0.1
# disjoint="functions": the share of functions kept for held-out only
HELDOUT_FUNCTION_FRACTION = 0.25
_INT_BOUND = 10**18  # results beyond it are not compared (no expected value is anywhere near)


@dataclass(frozen=True)
class Family:
    """Expressions ``template.format(a=..., b=...)`` over the constants' ranges (given coef_max)."""

    template: str
    # (x, a, b) -> f(x): computed here, never by evaluating the template
    fn: Callable[[int, int, int], int]
    a: Callable[[int], range]
    b: Callable[[int], range]


FAMILIES: dict[str, Family] = {
    "linear": Family(
        "{a}*x+{b}", lambda x, a, b: a * x + b, lambda c: range(2, c + 1), lambda c: range(0, c + 1)
    ),
    "square": Family(
        "x*x+{b}", lambda x, a, b: x * x + b, lambda c: range(1), lambda c: range(0, c + 1)
    ),
    "scaled": Family(
        "(x+{a})*{b}",
        lambda x, a, b: (x + a) * b,
        lambda c: range(1, c + 1),
        lambda c: range(2, c + 1),
    ),
    "mod": Family("x%{b}", lambda x, a, b: x % b, lambda c: range(1), lambda c: range(2, c + 1)),
    "max": Family(
        "max(x,{b})", lambda x, a, b: max(x, b), lambda c: range(1), lambda c: range(1, c + 1)
    ),
    "min": Family(
        "min(x,{b})", lambda x, a, b: min(x, b), lambda c: range(1), lambda c: range(1, c + 1)
    ),
    "reverse": Family(
        "{b}-x", lambda x, a, b: b - x, lambda c: range(1), lambda c: range(0, c + 1)
    ),
}
# 116 distinct functions on 0..9 (80 linear)
DEFAULT_FAMILIES = (
    "linear",
    "square",
    "mod",
    "max",
    "min",
)


@dataclass(frozen=True)
class PyfuncExample:
    family: str
    expression: str  # the reference answer, e.g. "2*x+1"
    shown: tuple[tuple[int, int], ...]  # (x, f(x)) pairs in the prompt, x ascending
    hidden_inputs: tuple[int, ...]  # the tests' inputs (disjoint from the shown ones)
    # expected values: compared outside the sandbox, never sent into it
    hidden_outputs: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return format_prompt(self)


def format_prompt(example: PyfuncExample) -> str:
    """``"f(1)=3 f(2)=5 f(4)=9 | def f(x): return"``: the model continues with the expression."""
    return " ".join(f"f({x})={y}" for x, y in example.shown) + " " + MARKER


def completion(example: PyfuncExample) -> str:
    """The reference continuation of the prompt (EOS is the tokenizer's business)."""
    return f" {example.expression}"


def corpus(examples: Iterable[PyfuncExample]) -> Iterator[str]:
    """Prompt + reference completion texts, for the tokenizer and an SFT warm-start."""
    for ex in examples:
        yield format_prompt(ex) + completion(ex)


# ------------------------------------------------------------------ splits
def functions(
    families: Sequence[str], coef_max: int, x_max: int
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(family, expression, values on 0..x_max) of every distinct function, the first spelling in
    ``families`` order kept (so "(x+1)*2" is dropped when "linear" comes first and has "2*x+2")."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for name in families:
        fam = FAMILIES[name]
        for a in fam.a(coef_max):
            for b in fam.b(coef_max):
                values = tuple(fam.fn(x, a, b) for x in range(x_max + 1))
                if values not in seen:
                    seen.add(values)
                    out.append((name, fam.template.format(a=a, b=b), values))
    return out


def _pick(rng: random.Random, pool: list[int], k: int) -> list[int]:
    """``k`` distinct items of ``pool`` (removed from it), drawn with randint (version-stable)."""
    return [pool.pop(randint(rng, 0, len(pool) - 1)) for _ in range(k)]


def _draw(
    rng: random.Random,
    funcs: list[tuple[str, str, tuple[int, ...]]],
    n_shown: int,
    n_hidden: int,
    x_max: int,
) -> PyfuncExample:
    family, expression, values = funcs[randint(rng, 0, len(funcs) - 1)]
    inputs = list(range(x_max + 1))
    shown, hidden = sorted(_pick(rng, inputs, n_shown)), tuple(_pick(rng, inputs, n_hidden))
    return PyfuncExample(
        family=family,
        expression=expression,
        shown=tuple((x, values[x]) for x in shown),
        hidden_inputs=hidden,
        hidden_outputs=tuple(values[x] for x in hidden),
    )


def make_splits(
    seed: int,
    n_train: int,
    n_heldout: int,
    families: tuple[str, ...] = DEFAULT_FAMILIES,
    n_shown: int = 3,
    n_hidden: int = 5,
    coef_max: int = 9,
    x_max: int = 9,
    disjoint: Literal["examples", "functions"] = "examples",
) -> tuple[list[PyfuncExample], list[PyfuncExample]]:
    """Deterministic, disjoint (train, heldout); see the module docstring for what ``disjoint`` keeps apart."""
    unknown = sorted(set(families) - set(FAMILIES))
    if not families or unknown:
        raise ValueError(
            f"families must be a non-empty subset of {', '.join(FAMILIES)}; unknown: {unknown}"
        )
    if n_shown < 1 or n_hidden < 1 or n_shown + n_hidden > x_max + 1:
        raise ValueError(
            f"need n_shown >= 1, n_hidden >= 1 and n_shown + n_hidden <= x_max + 1 inputs, got "
            f"n_shown={n_shown}, n_hidden={n_hidden}, x_max={x_max}"
        )
    if coef_max < 2:
        raise ValueError(f"coef_max must be >= 2, got {coef_max}")
    if disjoint not in ("examples", "functions"):
        raise ValueError(f"disjoint must be 'examples' or 'functions', got {disjoint!r}")
    rng = random.Random(seed)
    funcs = functions(families, coef_max, x_max)
    train_funcs = heldout_funcs = funcs
    if disjoint == "functions":
        if len(funcs) < 2:
            raise ValueError(
                f"disjoint='functions' needs at least 2 distinct functions, the options give {len(funcs)}"
            )
        pool = list(range(len(funcs)))
        held = set(_pick(rng, pool, max(1, round(HELDOUT_FUNCTION_FRACTION * len(funcs)))))
        heldout_funcs = [f for i, f in enumerate(funcs) if i in held]
        train_funcs = [f for i, f in enumerate(funcs) if i not in held]

    heldout = _distinct(
        lambda: _draw(rng, heldout_funcs, n_shown, n_hidden, x_max), n_heldout, set(), "held-out"
    )
    train = _distinct(
        lambda: _draw(rng, train_funcs, n_shown, n_hidden, x_max),
        n_train,
        {_key(e) for e in heldout},
        "training",
    )
    return train, heldout


# Chosen by experiment (2 CPU threads, default SftConfig: 4000 train examples, stop at 0.2 exact match on
# monitored train examples): SFT stops after 260-270 steps (80-120 s of training, ~20 s of sandboxed evaluation
# on 2 busy cores; SftConfig(eval_examples=200) takes ~70 s in all) at 0.25-0.31 held-out mean tests passed, 0.15-0.20 fully correct (seeds 0-2): linear functions are partly
# read, squares hardly, mod/max/min about half. disjoint="functions" gives 0.17 (0.05 fully correct).
DEFAULT_OPTIONS = {
    name: p.default
    for name, p in inspect.signature(make_splits).parameters.items()
    if p.default is not inspect.Parameter.empty
}


def _key(e: PyfuncExample) -> tuple:
    """An example's identity: its function (one spelling per function) and the inputs shown."""
    return e.expression, tuple(x for x, _ in e.shown)


def _distinct(
    draw: Callable[[], PyfuncExample], n: int, taken: set[tuple], which: str
) -> list[PyfuncExample]:
    """The first ``n`` draws whose keys are new (and not in ``taken``); raises when the space is too small."""
    return unique_stream(
        draw,
        _key,
        n,
        20 * n + 1000,
        taken,
        widen=f"for the {which} split: more families, a larger coef_max, x_max or n_shown",
    )


# ------------------------------------------------------------------ reading a response
@dataclass(frozen=True)
class Response:
    """What is known about a response without running it."""

    # its first line, stripped, when that is one Python expression (else None)
    expression: str | None
    well_formed: bool  # the whole response is that one line
    tree: str | None  # ast.dump of the expression (compared with the reference's)


def _parse(expression: str) -> ast.Expression | None:
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        # parsing only: nothing is evaluated
        return ast.parse(expression, "<response>", mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def read_response(text: str) -> Response:
    """The answer is the first non-blank line; well formed when nothing else is there and it parses as an
    expression ("x+1 # ok" and " 2*x+1 " are fine; "2*x+1\\nf(5)=11" runs "2*x+1" and is not well formed)."""
    lines = text.strip().splitlines()
    first = lines[0].strip() if lines else ""
    tree = _parse(first)
    if tree is None:
        return Response(expression=None, well_formed=False, tree=None)
    return Response(expression=first, well_formed=len(lines) == 1, tree=ast.dump(tree))


def known_tests(example: PyfuncExample, response: Response) -> float | None:
    """The tests fraction when no run is needed: 0 for a non-expression, 1 for the reference's own syntax
    tree (the same program as the reference; spacing and redundant parentheses aside); else None."""
    if response.expression is None:
        return 0.0
    reference = _parse(example.expression)
    if reference is not None and response.tree == ast.dump(reference):
        return 1.0
    return None


# ------------------------------------------------------------------ the sandboxed program
_HARNESS = '''\
import ast, builtins, json, signal, sys

EXPRESSION = {expression!r}
INPUTS = {inputs!r}
PER_INPUT_S = {per_input_s!r}
BOUND = {bound!r}


class _Sink:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


class _InputTimeout(BaseException):
    pass


_armed = [False]


def _expired(signum, frame):
    if _armed[0]:  # a late signal after the input finished is ignored
        raise _InputTimeout


def _candidate():
    """def f(x): return EXPRESSION, built as a syntax tree: the text cannot change the structure."""
    body = ast.parse(EXPRESSION, "<response>", mode="eval").body
    module = ast.parse("def f(x):\\n    return None\\n")
    module.body[0].body[0].value = body
    namespace = {{"__builtins__": builtins, "__name__": "candidate"}}
    exec(compile(ast.fix_missing_locations(module), "<response>", "exec"), namespace)
    return namespace["f"]


def _main():
    out = sys.stdout
    sys.stdout = sys.stderr = _Sink()
    signal.signal(signal.SIGALRM, _expired)
    try:
        f = _candidate()
    except BaseException:
        f = None
    results = []
    for x in INPUTS:
        value = None
        if f is not None:
            try:
                _armed[0] = True
                signal.setitimer(signal.ITIMER_REAL, PER_INPUT_S)
                try:
                    y = f(x)
                finally:
                    _armed[0] = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
                if type(y) is int and -BOUND <= y <= BOUND:
                    value = y
            except BaseException:
                value = None
        results.append(value)
    out.write({prefix!r} + json.dumps(results) + "\\n")
    out.flush()


_main()
'''


def harness_source(expression: str, inputs: Sequence[int], per_input_s: float = PER_INPUT_S) -> str:
    """The program that runs ``def f(x): return <expression>`` on every input inside the sandbox and prints
    ``RESULT [y, ...]`` (null where an input failed: exception, timeout, a result that is not an int).
    The expression enters as a string literal (repr) and is parsed there; the expected values never do."""
    return _HARNESS.format(
        expression=expression,
        inputs=[int(x) for x in inputs],
        per_input_s=float(per_input_s),
        bound=_INT_BOUND,
        prefix=RESULT_PREFIX,
    )


def results_passed(example: PyfuncExample, result: SandboxResult) -> float:
    """Fraction of hidden tests passed according to the program's last ``RESULT`` line; 0 when the program
    did not end normally or printed no well-formed result. Only ints equal to the expected values pass."""
    if not result.ok:
        return 0.0
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        return 0.0
    try:
        values = json.loads(lines[-1][len(RESULT_PREFIX) :])
    except (ValueError, RecursionError):
        return 0.0
    expected = example.hidden_outputs
    if not isinstance(values, list) or len(values) != len(expected):
        return 0.0
    return sum(type(v) is int and v == want for v, want in zip(values, expected)) / len(expected)


# ------------------------------------------------------------------ scoring
_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()


def sandbox_limits(**overrides: float) -> SandboxLimits:
    """Limits of one scoring program: a few seconds, 256 MB, 8 processes, small output (``overrides`` win)."""
    base = dict(
        wall_s=5.0,
        cpu_s=5.0,
        memory_mb=256,
        nproc=8,
        nofile=32,
        fsize_mb=1,
        output_bytes=4096,
        tmpfs_mb=8,
    )
    return SandboxLimits(**{**base, **overrides})


def sandbox() -> Sandbox:
    """The module's sandbox for ``score`` (created on first use, with ``sandbox_limits()``). Fails closed:
    without working bubblewrap it raises SandboxUnavailable saying so; nothing runs outside a sandbox."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            try:
                _sandbox = Sandbox(sandbox_limits())
            except SandboxUnavailable as e:
                raise SandboxUnavailable(
                    f"the pyfunc task runs every answer in a bubblewrap sandbox, and none can "
                    f"be made here: {e}"
                ) from e
        return _sandbox


def _per_input_s(limits: SandboxLimits, n_inputs: int) -> float:
    """Each input's timer: PER_INPUT_S, less when all of them would not fit the program's deadline."""
    return min(PER_INPUT_S, max(0.05, (limits.wall_s - 1.0) / max(1, n_inputs)))


def score_components_batch(
    examples: Sequence[PyfuncExample],
    texts: Sequence[str],
    runner: Sandbox | SandboxPool | None = None,
    *,
    format_penalty: float = FORMAT_PENALTY,
) -> tuple[list[dict[str, float]], list[SandboxResult]]:
    """``{"tests": fraction passed, "format": 0 or -format_penalty}`` per (example, response text), and the
    results of the programs that ran (for counters). ``runner``: a SandboxPool runs the programs concurrently,
    a Sandbox one after another; None: the module's sandbox."""
    if len(examples) != len(texts):
        raise ValueError(f"{len(examples)} examples but {len(texts)} responses")
    runner = runner if runner is not None else sandbox()
    limits = runner.sandbox.limits if isinstance(runner, SandboxPool) else runner.limits
    responses = [read_response(t) for t in texts]
    tests = [known_tests(e, r) for e, r in zip(examples, responses)]
    todo = [i for i, t in enumerate(tests) if t is None]
    jobs = [
        harness_source(
            responses[i].expression,
            examples[i].hidden_inputs,  # type: ignore[arg-type]
            _per_input_s(limits, len(examples[i].hidden_inputs)),
        )
        for i in todo
    ]
    results = (
        runner.map(jobs) if isinstance(runner, SandboxPool) else [runner.run(job) for job in jobs]
    )
    for i, result in zip(todo, results):
        tests[i] = results_passed(examples[i], result)
    components = [
        {"tests": float(t), "format": 0.0 if r.well_formed else -float(format_penalty)}
        for t, r in zip(tests, responses)
    ]
    return components, results


def score_components(
    example: PyfuncExample,
    text: str,
    sandbox: Sandbox | SandboxPool | None = None,
    *,
    format_penalty: float = FORMAT_PENALTY,
) -> dict[str, float]:
    """``{"tests": ..., "format": ...}`` of one response (see ``score_components_batch``)."""
    return score_components_batch([example], [text], sandbox, format_penalty=format_penalty)[0][0]


def score(example: PyfuncExample, response_text: str) -> float:
    """Fraction of the hidden tests the response's expression passes, run in the module's sandbox."""
    return score_components(example, response_text)["tests"]


def score_batch(examples: Sequence[PyfuncExample], texts: Sequence[str]) -> list[float]:
    """``score`` of many responses, their programs run concurrently (one per CPU of this process)."""
    with SandboxPool(sandbox()) as pool:
        return [c["tests"] for c in score_components_batch(examples, texts, pool)[0]]
