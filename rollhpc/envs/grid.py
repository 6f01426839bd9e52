"""What the grid environments (FrozenLake, Sokoban) share: the four direction words and how a policy's
text is read as one of them.

Why lenient parsing: a tiny policy early in training writes "Left", "go up", "u" or "down." as often as
the bare word; reading those as the move it meant lets the reward speak about the move rather than the
spelling. Text that names no direction is not guessed at: the environment answers that the action was
invalid (and counts the turn), so sloppy text still costs something.

Why a strict mode too: leniency lets everything after the first direction go unread, and under RL that text
drifts. A turn's end-of-text token sits in every turn, failing episodes have more turns than winning ones, so
token-mean losses push it down on balance; once a tiny Sokoban policy stopped ending its turns (at ~75 steps
with GiGPO advantages) it wrote four tokens a turn ("down right up left"), the words after the first move
trained on noise, and the sampled entropy doubled. ``strict=True`` takes one direction word and nothing else,
so a rambling turn is invalid and pays the environment's format penalty.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

__all__ = ["DIRECTIONS", "OFFSETS", "parse_direction", "invalid_text", "reset_info"]

# gymnasium FrozenLake's order: LEFT=0, DOWN=1, RIGHT=2, UP=3
DIRECTIONS = (
    "left",
    "down",
    "right",
    "up",
)
OFFSETS = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}  # (row, column) steps
_WORD = re.compile(r"\b(left|down|right|up)\b")
_LETTER = {d[0]: d for d in DIRECTIONS}  # l, d, r, u


def parse_direction(text: str, strict: bool = False) -> str | None:
    """The first direction word in ``text`` (any case, anywhere: "Go LEFT."), or a response that is one of the
    letters l/d/r/u alone; None when it names no direction.

    The first word, not the last: a policy that writes "left, then up" commits to its first move, one per turn.
    ``strict``: the text must be one direction word alone (any case, surrounding white space and a final
    period allowed); anything else is None.
    """
    lowered = text.lower()
    if strict:
        word = lowered.strip().removesuffix(".")
        return word if word in DIRECTIONS else None
    found = _WORD.search(lowered)
    if found:
        return found.group(1)
    return _LETTER.get(lowered.strip().rstrip("."))


def invalid_text() -> str:
    """The observation after text that names no direction: short (it costs tokens in the row) and says what
    would have been valid."""
    return "Invalid action: answer left, down, right or up."


def reset_info(instruction: str, state_key: Hashable) -> dict[str, Any]:
    """The info a grid environment's ``reset`` returns: the instruction, the first state's key, no success yet."""
    return {"instruction": instruction, "state_key": state_key, "success": False}
