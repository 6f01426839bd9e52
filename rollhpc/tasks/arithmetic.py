"""Multi-digit arithmetic (``123 + 456 =``) with an exact, rule-based reward.

The first task for the tiny Qwen2 policy: the answer is one integer, so correctness is a string
comparison and the reward cannot be gamed by style. Operands have up to ``digits`` digits; the
tokenizer isolates digits, so the model learns the column algorithm rather than memorising numbers.
Train and held-out splits are disjoint by construction (an example's key is its operands and
operator), so held-out accuracy measures generalisation, not recall.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

ANSWER_MARKERS = ("Answer:", "=")
# A minus sign belongs to the number unless it follows a word or ")" ("5-3" is not "5" and "-3").
_INTEGER = re.compile(r"(?:(?<![\w)])-)?[0-9]+")  # ASCII digits only
_OPS: dict[str, Callable[[int, int], int]] = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
T = TypeVar("T")


@dataclass(frozen=True)
class ArithmeticExample:
    a: int
    op: str  # one of "+", "-", "*"
    b: int
    answer: str  # ground truth, the decimal result
    # the reference completion shows the column sums before the answer (``show_work``)
    work: bool = False

    @property
    def prompt(self) -> str:
        return format_prompt(self)


def format_prompt(example: ArithmeticExample) -> str:
    """``"123 + 456 ="``: no chat template, the model continues after the "=" marker."""
    return f"{example.a} {example.op} {example.b} ="


def completion(example: ArithmeticExample) -> str:
    """The reference continuation of the prompt (EOS is the tokenizer's business): the answer, or with
    ``work`` the column sums right to left, carries included, then ``Answer: N``."""
    if not example.work:
        return f" {example.answer}"
    return f" {column_sums(example.a, example.b)} Answer: {example.answer}"


def column_sums(a: int, b: int) -> str:
    """``"1+7=8 2+5=7 8+9=17 4+3+1=8"`` for 4821 + 3957: each column's digits (and the carry) and their sum,
    from the ones up; a longer response that makes the task one a model works through, not recalls."""
    steps, carry, column = [], 0, 0
    while a or b or carry or column == 0:
        x, y = a % 10, b % 10
        total = x + y + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
        carry, a, b, column = total // 10, a // 10, b // 10, column + 1
    return " ".join(steps)


def randint(rng: random.Random, lo: int, hi: int) -> int:
    """Uniform in [lo, hi] from ``rng.random()`` alone, the one stream Python promises to keep
    identical across versions (``randrange`` may change), so splits stay the same everywhere."""
    return lo + min(int(rng.random() * (hi - lo + 1)), hi - lo)


def sample(
    rng: random.Random,
    digits: int = 3,
    ops: tuple[str, ...] = ("+", "-"),
    allow_negative: bool = False,
    show_work: bool = False,
) -> ArithmeticExample:
    """One example with operands in [0, 10**digits); without ``allow_negative`` a - b has a >= b."""
    a, b = randint(rng, 0, 10**digits - 1), randint(rng, 0, 10**digits - 1)
    op = ops[randint(rng, 0, len(ops) - 1)]
    if op == "-" and not allow_negative and a < b:
        a, b = b, a
    return ArithmeticExample(a=a, op=op, b=b, answer=str(_OPS[op](a, b)), work=show_work)


def unique_stream(
    draw: Callable[[], T],
    key: Callable[[T], Hashable],
    n: int,
    max_draws: int,
    taken: Iterable[Hashable] = (),
    widen: str = "more digits / numbers",
) -> list[T]:
    """The first ``n`` examples from ``draw()`` with distinct keys, none of them in ``taken``; raises when the
    space is too small (saying how to ``widen`` the task)."""
    seen: set[Hashable] = set(taken)
    out: list[T] = []
    for _ in range(max_draws):
        if len(out) == n:
            break
        ex = draw()
        if (k := key(ex)) not in seen:
            seen.add(k)
            out.append(ex)
    if len(out) < n:
        raise ValueError(
            f"found only {len(out)} distinct examples of the {n} asked for in {max_draws} draws: "
            f"ask for fewer or widen the task ({widen})"
        )
    return out


def make_splits(
    seed: int,
    n_train: int,
    n_heldout: int,
    digits: int = 3,
    ops: tuple[str, ...] = ("+", "-"),
    allow_negative: bool = False,
    show_work: bool = False,
) -> tuple[list[ArithmeticExample], list[ArithmeticExample]]:
    """Deterministic, disjoint (train, heldout). Held-out examples are drawn first, so the held-out
    set for a seed does not change when ``n_train`` does. ``show_work`` (additions only): reference
    completions write the column sums before the answer (``column_sums``), so responses run to tens of
    tokens; the reward still reads the number after "Answer:"."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if not ops or set(ops) - set(_OPS):
        raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {ops!r}")
    if show_work and set(ops) != {"+"}:
        raise ValueError(
            f"show_work writes column sums of additions: set ops to ['+'], got {list(ops)}"
        )
    rng = random.Random(seed)
    n = n_train + n_heldout
    examples = unique_stream(
        lambda: sample(rng, digits, ops, allow_negative, show_work),
        lambda e: (e.a, e.op, e.b),
        n,
        max_draws=20 * n + 1000,
    )
    return examples[n_heldout:], examples[:n_heldout]


def text_after_marker(response: str, markers: tuple[str, ...] = ANSWER_MARKERS) -> str:
    """The text after the last occurrence of the first marker found (in ``markers`` order), else all of it.

    Prompts end with a marker, so a bare continuation (" 579") is its own answer; a model that
    restates the problem ("123 + 456 = 579") or writes "Answer: 579" is read the same way.
    """
    for marker in markers:
        if marker in response:
            return response.rsplit(marker, 1)[1]
    return response


def extract_answer(response_text: str) -> str | None:
    """The final integer after the answer marker, normalised ("007" -> "7", "-0" -> "0"); None if absent.

    Normalised as text, not with int(): a response of 10,000 digits must score 0, not raise.
    """
    found = _INTEGER.findall(text_after_marker(response_text))
    if not found:
        return None
    negative, digits = found[-1].startswith("-"), found[-1].lstrip("-").lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


def score(example: ArithmeticExample, response_text: str) -> float:
    """1.0 when the extracted integer equals the ground truth, else 0.0."""
    return 1.0 if extract_answer(response_text) == example.answer else 0.0


def corpus(examples: Iterable[ArithmeticExample]) -> Iterator[str]:
    """Prompt + reference completion texts, for the tokenizer and an SFT warm-start."""
    for ex in examples:
        yield format_prompt(ex) + completion(ex)
