"""Fractions and decimals (``What is 3/4 + 1/8?``), answered in ``\\boxed{}`` and scored with math-verify.

The free-form counterpart of ``arithmetic``: the answer is a value with many right spellings (``7/8``,
``\\frac{7}{8}``, ``14/16``, ``0.875``), so a string comparison would refuse right answers and the reward
needs math-verify (``rollhpc.rewards.math_verify``). The reward still pays only for a number: a response
that copies the question into the box (``\\boxed{3/4 + 1/8}``) has the right value but is not an answer.

Operands are n/d with n <= ``max_numerator`` and d <= ``max_denominator`` (single digits by default, so the
tiny policy can learn some of it), reduced, written as integers when d = 1 and, with probability
``decimal_share``, as decimals when d has no prime factor but 2 and 5 (``0.75``). References are reduced
fractions or integers. Splits are disjoint by the problem as written, and deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction

from rollhpc.rewards.math_verify import score_answer
from rollhpc.tasks.arithmetic import randint, unique_stream

_OPS: dict[str, Callable[[Fraction, Fraction], Fraction]] = {
    "+": Fraction.__add__,
    "-": Fraction.__sub__,
    "*": Fraction.__mul__,
}


@dataclass(frozen=True)
class FreeformMathExample:
    a: str  # operand as shown: "3/4", "0.5", "2"
    op: str  # one of "+", "-", "*"
    b: str
    answer: str  # ground truth: a reduced fraction ("7/8", "-1/8") or an integer ("2")

    @property
    def prompt(self) -> str:
        return format_prompt(self)


def format_prompt(example: FreeformMathExample) -> str:
    return f"What is {example.a} {example.op} {example.b}? Put the answer in \\boxed{{}}."


def completion(example: FreeformMathExample) -> str:
    """The reference continuation of the prompt (EOS is the tokenizer's business)."""
    return f" \\boxed{{{example.answer}}}"


def reference(example: FreeformMathExample) -> str:
    """The answer a judge is shown (``rollhpc.rewards.judge.judge_fields``)."""
    return example.answer


def written(value: Fraction, as_decimal: bool) -> str:
    """``value`` as ``n/d``, an integer, or (``as_decimal`` and a terminating decimal) ``0.75``."""
    if value.denominator == 1:
        return str(value.numerator)
    if as_decimal and _terminates(value.denominator):
        return _decimal(value)
    return f"{value.numerator}/{value.denominator}"


def _terminates(d: int) -> bool:
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _decimal(value: Fraction) -> str:
    """Exact decimal text of a terminating fraction (no float rounding)."""
    sign, value = ("-" if value < 0 else ""), abs(value)
    whole, rest = divmod(value.numerator, value.denominator)
    digits = ""
    while rest:
        rest *= 10
        digit, rest = divmod(rest, value.denominator)
        digits += str(digit)
    return f"{sign}{whole}.{digits}"


def sample(
    rng: random.Random,
    max_numerator: int = 9,
    max_denominator: int = 9,
    ops: tuple[str, ...] = ("+", "-", "*"),
    decimal_share: float = 0.2,
    allow_negative: bool = False,
) -> FreeformMathExample:
    """One problem; without ``allow_negative`` a - b has a >= b."""

    def operand() -> Fraction:
        return Fraction(randint(rng, 1, max_numerator), randint(rng, 1, max_denominator))

    a, b = operand(), operand()
    op = ops[randint(rng, 0, len(ops) - 1)]
    if op == "-" and not allow_negative and a < b:
        a, b = b, a
    a_text, b_text = (
        written(a, rng.random() < decimal_share),
        written(b, rng.random() < decimal_share),
    )
    return FreeformMathExample(
        a=a_text, op=op, b=b_text, answer=written(_OPS[op](a, b), as_decimal=False)
    )


def make_splits(
    seed: int,
    n_train: int,
    n_heldout: int,
    max_numerator: int = 9,
    max_denominator: int = 9,
    ops: tuple[str, ...] = ("+", "-", "*"),
    decimal_share: float = 0.2,
    allow_negative: bool = False,
) -> tuple[list[FreeformMathExample], list[FreeformMathExample]]:
    """Deterministic, disjoint (train, heldout); held-out examples are drawn first (stable as n_train changes)."""
    if max_numerator < 1 or max_denominator < 1:
        raise ValueError(
            f"max_numerator and max_denominator must be >= 1, got {max_numerator}, {max_denominator}"
        )
    if not ops or set(ops) - set(_OPS):
        raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {ops!r}")
    if not 0 <= decimal_share <= 1:
        raise ValueError(f"decimal_share must be in [0, 1], got {decimal_share}")
    rng = random.Random(seed)
    n = n_train + n_heldout
    examples = unique_stream(
        lambda: sample(rng, max_numerator, max_denominator, ops, decimal_share, allow_negative),
        lambda e: (e.a, e.op, e.b),
        n,
        max_draws=20 * n + 1000,
    )
    return examples[n_heldout:], examples[:n_heldout]


def score(example: FreeformMathExample, response_text: str) -> float:
    """1.0 when the response's answer (boxed, else its last number) equals the reference, else 0.0."""
    return score_answer(response_text, example.answer, number_only=True)


def corpus(examples: Iterable[FreeformMathExample]) -> Iterator[str]:
    """Prompt + reference completion texts, for the tokenizer and an SFT warm-start."""
    for ex in examples:
        yield format_prompt(ex) + completion(ex)
