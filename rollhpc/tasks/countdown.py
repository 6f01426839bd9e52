"""Countdown: combine the given numbers with + - * / to hit a target, each number at most once.

A search task with many right answers, so the reward is a checker rather than a comparison: the
response's expression is parsed with ``ast`` (never evaluated by Python), only integer literals
and the four binary operators are accepted, the literals must be drawn from the given numbers,
and the value, computed exactly with fractions, must equal the target. Every example is generated
with a witness solution, so each one is solvable and the witness can seed an SFT warm-start.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction

from rollhpc.tasks.arithmetic import randint, text_after_marker, unique_stream

MAX_EXPRESSION_CHARS = 200  # longer responses are not a countdown answer; bounds parsing work
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() ]+")  # no letters, "_", "." or "**"-free tricks like 0x10
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass(frozen=True)
class CountdownExample:
    numbers: tuple[int, ...]
    target: int  # ground truth
    solution: str  # one expression that reaches the target (a witness, not the only answer)

    @property
    def prompt(self) -> str:
        return format_prompt(self)


def format_prompt(example: CountdownExample) -> str:
    return f"Numbers: {' '.join(map(str, example.numbers))}\nTarget: {example.target}\nAnswer:"


def completion(example: CountdownExample) -> str:
    """The reference continuation of the prompt (EOS is the tokenizer's business)."""
    return f" {example.solution}"


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[Fraction, str] | None:
    """Combine ``numbers`` pairwise in random order with random operators; None on division by zero."""
    terms = [(Fraction(n), str(n)) for n in numbers]
    while len(terms) > 1:
        (x, xs), (y, ys) = (
            terms.pop(randint(rng, 0, len(terms) - 1)),
            terms.pop(randint(rng, 0, len(terms) - 1)),
        )
        op = (ast.Add, ast.Sub, ast.Mult, ast.Div)[randint(rng, 0, 3)]
        if op is ast.Div and y == 0:
            return None
        terms.append((_BINOPS[op](x, y), f"({xs} {_SYMBOLS[op]} {ys})"))
    value, text = terms[0]
    return value, text[1:-1] if text.startswith("(") else text


def sample(
    rng: random.Random, num_numbers: int = 4, max_number: int = 20, max_target: int = 100
) -> CountdownExample:
    """Numbers in [1, max_number]; target a positive integer <= max_target reached by a random
    expression over 2..num_numbers of them, and not already one of the numbers."""
    while True:
        numbers = [randint(rng, 1, max_number) for _ in range(num_numbers)]
        # a random subset, drawn with randint (not rng.shuffle) to stay version-stable
        pool = numbers[:]
        used = [
            pool.pop(randint(rng, 0, len(pool) - 1)) for _ in range(randint(rng, 2, num_numbers))
        ]
        made = _random_expression(rng, used)
        if made is None:
            continue
        value, text = made
        if value.denominator == 1 and 1 <= value <= max_target and int(value) not in numbers:
            return CountdownExample(numbers=tuple(numbers), target=int(value), solution=text)


def make_splits(
    seed: int,
    n_train: int,
    n_heldout: int,
    num_numbers: int = 4,
    max_number: int = 20,
    max_target: int = 100,
) -> tuple[list[CountdownExample], list[CountdownExample]]:
    """Deterministic, disjoint (train, heldout); disjoint as problems (sorted numbers and target),
    so a reordering of a held-out problem never appears in training. Held-out examples are drawn
    first, so they do not depend on ``n_train``."""
    if num_numbers < 2:
        raise ValueError(f"num_numbers must be >= 2, got {num_numbers}")
    if max_number < 1 or max_target < 1:
        raise ValueError(f"max_number ({max_number}) and max_target ({max_target}) must be >= 1")
    rng = random.Random(seed)
    n = n_train + n_heldout
    examples = unique_stream(
        lambda: sample(rng, num_numbers, max_number, max_target),
        lambda e: (tuple(sorted(e.numbers)), e.target),
        n,
        max_draws=20 * n + 1000,
    )
    return examples[n_heldout:], examples[:n_heldout]


def extract_answer(response_text: str) -> str | None:
    """The expression after "Answer:" (or the whole response), first line only, with a trailing
    "= <number>" dropped and "×"/"÷" read as "*"/"/"; None when nothing is left."""
    text = text_after_marker(response_text, ("Answer:",)).strip()
    text = text.splitlines()[0] if text else ""
    text = text.replace("×", "*").replace("÷", "/")
    parts = [p.strip() for p in text.split("=")]
    with_ops = [p for p in parts if p and any(c in p for c in "+-*/")]
    expression = with_ops[-1] if with_ops else (parts[0] if parts else "")
    return expression.rstrip(".").strip() or None


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integer literals used) of an expression of + - * / and parentheses over
    non-negative integer literals; None for anything else (names, calls, unary minus, floats,
    powers, floor division, division by zero, syntax errors)."""
    if len(expression) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        return walk(tree.body), literals
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def score(example: CountdownExample, response_text: str) -> float:
    """1.0 when the response's expression uses only the given numbers, each at most once, and
    evaluates exactly to the target; else 0.0."""
    expression = extract_answer(response_text)
    result = evaluate(expression) if expression is not None else None
    if result is None:
        return 0.0
    value, literals = result
    if Counter(literals) - Counter(example.numbers):  # some literal used more often than given
        return 0.0
    return 1.0 if value == example.target else 0.0


def corpus(examples: Iterable[CountdownExample]) -> Iterator[str]:
    """Prompt + witness completion texts, for the tokenizer and an SFT warm-start."""
    for ex in examples:
        yield format_prompt(ex) + completion(ex)
