"""An LLM judge's reward, apart from where the judge runs: prompt rendering, strict verdicts, counters.

The judge role (``rollhpc.workers.judge``) owns a backend (an in-process vLLM engine or an HTTP server);
everything it does with the text lives here, so both backends score the same way and tests can drive
this logic with any backend: ``JudgeBackend.complete(prompts, max_tokens)`` returns each prompt's
greedy output, or None when the backend could not produce one (a failure, scored 0 and counted).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Protocol

from rollhpc.rewards.judge_parse import JudgeMode, parse_verdict

__all__ = [
    "DEFAULT_TEMPLATES",
    "JudgeBackend",
    "JudgeCounters",
    "judge_fields",
    "judge_outputs",
    "render_prompt",
    "check_template",
]

_GRADE = "You are grading an answer.\nQuestion: {question}\nAnswer: {response}\nReference answer: {reference}\n"
DEFAULT_TEMPLATES: dict[
    str, str
] = {  # by mode; each states the exact verdict format parse_verdict accepts
    "yes_no": _GRADE + "Is the answer correct? Reply with exactly YES or NO, nothing else.",
    "score": _GRADE
    + "Grade it from 0 to {max_score}. Reply with exactly `Score: N`, N an integer, nothing else.",
}
_PLACEHOLDER = re.compile(r"\{(question|response|reference|max_score)\}")


class JudgeBackend(Protocol):
    def complete(self, prompts: list[str], max_tokens: int) -> list[str | None]: ...


@dataclass
class JudgeCounters:
    """Since the role started: items judged, outputs that were no verdict, items with no output at all."""

    judge_calls: int = 0
    judge_unparsed: int = 0
    judge_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def check_template(template: str) -> None:
    """A template must show the judge the response; the other fields are optional."""
    if "{response}" not in template:
        raise ValueError(
            "the judge template needs a {response} field (and may use {question}, {reference}, "
            "{max_score})"
        )


def render_prompt(
    template: str, *, question: str, response: str, reference: str, max_score: int = 10
) -> str:
    """Fill ``{question}``, ``{response}``, ``{reference}``, ``{max_score}`` in one pass.

    Not ``str.format``: other braces in the template (``\\boxed{}``) stay as written, and a response that
    itself contains ``{reference}`` is not expanded into the reference answer.
    """
    values = {
        "question": question,
        "response": response,
        "reference": reference,
        "max_score": str(max_score),
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def judge_fields(example: object, task: ModuleType | None = None) -> tuple[str, str]:
    """``(question, reference)`` of an example.

    A mapping gives ``question`` and ``reference`` (a dataset row); a task example gives the task's
    prompt (``task.format_prompt``) and ``task.reference(example)`` if the task defines it, else the
    example's ``answer``.
    """
    if isinstance(example, dict):
        return str(example.get("question", "")), str(example.get("reference", ""))
    question = (
        task.format_prompt(example) if task is not None else str(getattr(example, "prompt", ""))
    )
    if task is not None and hasattr(task, "reference"):
        return question, str(task.reference(example))
    return question, str(getattr(example, "answer", ""))


def judge_outputs(
    outputs: list[str | None], mode: JudgeMode, max_score: int, counters: JudgeCounters
) -> list[float]:
    """Verdicts of the backend's outputs (None: failed), strictly parsed; ``counters`` are updated."""
    scores = []
    for out in outputs:
        counters.judge_calls += 1
        if out is None:
            counters.judge_failures += 1
            scores.append(0.0)
            continue
        score, parsed = parse_verdict(out, mode, max_score)
        counters.judge_unparsed += not parsed
        scores.append(score)
    return scores
