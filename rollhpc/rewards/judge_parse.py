"""Strict reading of a judge model's verdict: the whole output is the verdict, or it is not one.

Why strict: a lenient reader ("does the output contain YES?") is a reward a policy can game, by steering
the judge into "NO, the answer is not YES" or "Score: 10/10 ... Score: 0". Here only the exact forms count,
after surrounding whitespace is stripped:

- mode ``yes_no``: ``YES`` -> 1.0, ``NO`` -> 0.0 (upper case, nothing else: "YES." and "yes" are refused);
- mode ``score``: ``Score: N`` with N a canonical integer (no sign, no leading zero) in [0, max_score],
  normalised to N / max_score.

Anything else scores 0.0 and is reported as unparsed, so the run can count (and alert on) a judge that
ignores its format instead of quietly training on zeros.
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["JudgeMode", "parse_verdict"]

JudgeMode = Literal["yes_no", "score"]
# ASCII digits only; at most 9 digits before range check
_SCORE = re.compile(r"Score: (0|[1-9][0-9]{0,8})")


def parse_verdict(output: str, mode: JudgeMode, max_score: int = 10) -> tuple[float, bool]:
    """``(score in [0, 1], parsed)``; an unparsed output scores 0.0."""
    text = output.strip()
    if mode == "yes_no":
        if text == "YES":
            return 1.0, True
        if text == "NO":
            return 0.0, True
        return 0.0, False
    if mode == "score":
        if max_score < 1:
            raise ValueError(f"max_score must be >= 1, got {max_score}")
        m = _SCORE.fullmatch(text)
        if m is None or int(m.group(1)) > max_score:
            return 0.0, False
        return int(m.group(1)) / max_score, True
    raise ValueError(f"unknown judge mode {mode!r}; modes are yes_no, score")
