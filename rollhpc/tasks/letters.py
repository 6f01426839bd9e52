"""Letter puzzles (``reverse: c a t =`` -> ``t a c``): a small "general" domain beside math and code.

Not arithmetic and not code: the answer is a rearrangement of the given letters (reverse them, sort them,
or drop the repeats), checked exactly as text, so the reward is a rule a tiny policy cannot game. Letters are
written space-separated so that the tokenizer sees one letter per token, as digits are in ``arithmetic``.
Train and held-out splits are disjoint by construction (an example's key is its operation and letters).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from rollhpc.tasks.arithmetic import randint, text_after_marker, unique_stream

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
OPS = {"reverse": lambda xs: xs[::-1], "sort": sorted, "dedup": lambda xs: list(dict.fromkeys(xs))}


@dataclass(frozen=True)
class LettersExample:
    op: str  # one of OPS
    letters: tuple[str, ...]
    answer: str  # the expected letters, space-separated

    @property
    def prompt(self) -> str:
        return format_prompt(self)


def format_prompt(example: LettersExample) -> str:
    return f"{example.op}: {' '.join(example.letters)} ="


def completion(example: LettersExample) -> str:
    return f" {example.answer}"


def sample(
    rng: random.Random, min_len: int, max_len: int, alphabet: str, ops: tuple[str, ...]
) -> LettersExample:
    n = randint(rng, min_len, max_len)
    letters = tuple(alphabet[randint(rng, 0, len(alphabet) - 1)] for _ in range(n))
    op = ops[randint(rng, 0, len(ops) - 1)]
    return LettersExample(op, letters, " ".join(OPS[op](list(letters))))


def make_splits(
    seed: int,
    n_train: int,
    n_heldout: int,
    min_len: int = 3,
    max_len: int = 5,
    alphabet: str = "abcdefgh",
    ops: tuple[str, ...] = ("reverse", "sort"),
) -> tuple[list[LettersExample], list[LettersExample]]:
    """Deterministic, disjoint (train, heldout); held-out examples are drawn first."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops must be a non-empty subset of {sorted(OPS)}, got {ops!r}")
    if not alphabet or set(alphabet) - set(ALPHABET):
        raise ValueError(f"alphabet must be lower-case letters, got {alphabet!r}")
    rng = random.Random(seed)
    n = n_train + n_heldout
    examples = unique_stream(
        lambda: sample(rng, min_len, max_len, alphabet, ops),
        lambda e: (e.op, e.letters),
        n,
        max_draws=20 * n + 1000,
    )
    return examples[n_heldout:], examples[:n_heldout]


def score(example: LettersExample, response_text: str) -> float:
    """1.0 when the letters after the "=" (spaces ignored at the ends) are exactly the answer."""
    answer = " ".join(text_after_marker(response_text, ("=",)).split())
    return 1.0 if answer == example.answer else 0.0


def corpus(examples: Iterable[LettersExample]) -> Iterator[str]:
    for ex in examples:
        yield format_prompt(ex) + completion(ex)
