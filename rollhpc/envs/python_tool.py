"""A tool-use environment: the policy may run Python in the code sandbox, turn after turn, before it answers
a task's question (arithmetic or countdown by default; any rollhpc task module works).

Why: the smallest setting where multi-turn RL has something to learn that single-turn RL has not: when
calling a tool pays (a 3-digit product is hard to do in the head of a tiny model, easy to ``print``) and
how to use its output in the answer.

Actions (one per turn, the first that matches; any case)::

    python: 123 * 456            run the code; a last expression is printed like a REPL's (here 56088)
    answer: 56088                end the episode; scored with the task's own ``score(example, text)``

Anything else is an invalid action (observation "Invalid action: ...", ``metrics.invalid_action`` 1); it
costs the turn. Each ``python:`` runs alone in a fresh sandbox (nothing persists between calls), with
small limits (``wall_s``, 256 MB, 8 processes); the observation is its stdout, or the error's last line,
cut to ``max_output_chars``. Reward: the answer's score (1.0 or 0.0 for arithmetic and countdown), 0 for
every other turn and for an episode that runs out of ``max_turns`` without an answer (truncated).
``success`` is score == 1. ``use_tool`` is True on tool turns; the last turn's ``metrics.tool_calls`` is the
episode's number of tool calls.

Question for a seed: the first example of ``make_splits(seed, 1, 0, **task_options)``, so a seed names one
question (the pipeline keeps training and evaluation seeds apart). The first observation is the task's
own prompt (``123 * 456 =``).

The code runs in ``rollhpc.sandbox.Sandbox``, which fails closed: without bubblewrap and user namespaces the
environment cannot be built (SandboxUnavailable says why), unless ``unsafe=True`` runs the code as a plain
subprocess with the same limits: for a laptop, never for a policy you do not trust.

Expert: one tool call that computes the answer (arithmetic: ``a op b``; countdown: the example's witness
expression, or one found by a small search), then ``answer:`` with the tool's output (arithmetic) or the
expression (countdown). For other tasks it answers the reference completion without a tool call.
"""

from __future__ import annotations

import operator
import re
from fractions import Fraction
from typing import Any

from rollhpc.envs.base import check_episode_running
from rollhpc.sandbox import Sandbox
from rollhpc.tasks import task_module
from rollhpc.tasks.arithmetic import ArithmeticExample
from rollhpc.tasks.countdown import CountdownExample
from rollhpc.tasks.pyfunc import sandbox_limits

__all__ = ["PythonTool", "ENV", "solve_countdown"]

INSTRUCTION = "Solve it. Write python: CODE to run Python, answer: TEXT to answer."
_ACTION = re.compile(r"^\s*(python|py|answer)\s*:\s?(.*)$", re.IGNORECASE | re.DOTALL)
# The program every tool call runs: it reads the policy's code from stdin and runs it like a REPL's cell,
# printing the value of a last bare expression. Fixed text, so the policy's code is data until it is inside.
_CELL_RUNNER = """\
import ast, sys
tree = ast.parse(sys.stdin.read(), "<tool>", "exec")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {"__name__": "__main__"}
exec(compile(tree, "<tool>", "exec"), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
    if value is not None:
        print(repr(value))
"""


class PythonTool:
    """Options: ``task`` (a task module name, default arithmetic), ``task_options`` (its make_splits keywords,
    e.g. ``{digits: 3, ops: [+, -, "*"]}``), ``max_turns`` (default 4), ``unsafe`` (run code without isolation,
    default False), ``wall_s`` (per tool call, default 5), ``max_output_chars`` (observation cap, default 200)."""

    # what a random policy picks from (the last one is invalid)
    ACTIONS = (
        "python: print(2 + 3)",
        "python: 12 * 34",
        "python: 1 / 0",
        "answer: 5",
        "answer: 408",
        "answer: (1 + 2) * 3",
        "hello",
    )

    def __init__(
        self,
        task: str = "arithmetic",
        task_options: dict[str, Any] | None = None,
        max_turns: int = 4,
        unsafe: bool = False,
        wall_s: float = 5.0,
        max_output_chars: int = 200,
    ) -> None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        if not isinstance(max_output_chars, int) or max_output_chars < 8:
            raise ValueError(f"max_output_chars must be an integer >= 8, got {max_output_chars!r}")
        self.task = task_module(task)
        self.task_options = dict(task_options or {})
        if "ops" in self.task_options:  # YAML gives a list; the tasks want a tuple
            self.task_options["ops"] = tuple(self.task_options["ops"])
        try:  # bad task options fail here, not at the first reset
            self.task.make_splits(0, 1, 0, **self.task_options)
        except TypeError as e:
            raise ValueError(
                f"task {task!r} does not take task_options {sorted(self.task_options)}: {e}"
            ) from None
        self.max_turns, self.max_output_chars = max_turns, max_output_chars
        # a tool call is a small program, limited like the pyfunc task's scoring programs
        limits = sandbox_limits(wall_s=wall_s, cpu_s=wall_s)
        # raises SandboxUnavailable where it cannot isolate
        self.sandbox = Sandbox(limits, unsafe=unsafe)
        # the task's example of the running episode (its module reads it)
        self.example: object = None
        self._turn, self._tool_calls, self._done = 0, 0, True
        self._last_output: str | None = None  # the last tool call's stdout when it succeeded

    # ------------------------------------------------------------------ the TextEnv protocol
    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.example = self.task.make_splits(int(seed), 1, 0, **self.task_options)[0][0]
        self._turn, self._tool_calls, self._done, self._last_output = 0, 0, False, None
        return self.task.format_prompt(self.example), {
            "instruction": INSTRUCTION,
            "state_key": self._state_key(),
        }

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_episode_running(self._done)
        self._turn += 1
        found = _ACTION.match(action)
        kind, text = (found.group(1).lower(), found.group(2).strip()) if found else ("invalid", "")
        reward, terminated, metrics = 0.0, False, {"invalid_action": float(kind == "invalid")}
        if kind == "answer":
            reward = float(self.task.score(self.example, text))
            terminated = True
            observation = "Correct." if reward == 1.0 else "Wrong."
        elif kind == "invalid":
            observation = "Invalid action: write python: CODE or answer: TEXT."
        else:
            self._tool_calls += 1
            observation = self._run_tool(text)
            metrics["tool_error"] = float(self._last_output is None)
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        if self._done:
            metrics["tool_calls"] = float(self._tool_calls)
        info = {
            "state_key": self._state_key(),
            "success": reward == 1.0,
            "use_tool": kind in ("python", "py"),
            "metrics": metrics,
        }
        return observation, reward, terminated, truncated, info

    def close(self) -> None:
        self.example = None

    def _run_tool(self, code: str) -> str:
        result = self.sandbox.run(_CELL_RUNNER, stdin=code)
        self._last_output = result.stdout.strip() if result.ok else None
        if result.ok:
            text = result.stdout.strip() or "(no output)"
        elif result.status == "error":
            lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
            text = lines[-1].strip() if lines else result.detail
        else:
            text = f"{result.status}: {result.detail}"
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars - 3] + "..."
        return text

    def _state_key(self) -> tuple[str, int, str | None]:
        """The question, the tool calls made and what the tool said last: equal keys, equal situations."""
        return self.task.format_prompt(self.example), self._tool_calls, self._last_output

    # ------------------------------------------------------------------ the expert
    def expert_action(self) -> str:
        """First compute with the tool, then answer from what it printed (see the module docstring)."""
        ex = self.example
        if isinstance(ex, ArithmeticExample):
            if self._tool_calls == 0:
                return f"python: {ex.a} {ex.op} {ex.b}"
            return f"answer: {self._last_output if self._last_output is not None else ex.answer}"
        if isinstance(ex, CountdownExample):
            expression = ex.solution or solve_countdown(ex.numbers, ex.target) or ""
            if self._tool_calls == 0 and expression:
                return f"python: {expression}"
            return f"answer: {expression}"
        return f"answer: {self.task.completion(ex).strip()}"


# (function, symbol, commutative)
_COMBINE = (
    (operator.add, "+", True),
    (operator.sub, "-", False),
    (operator.mul, "*", True),
    (operator.truediv, "/", False),
)


def solve_countdown(numbers: tuple[int, ...], target: int, budget: int = 100_000) -> str | None:
    """An expression over some of ``numbers`` (each at most once) equal to ``target``, or None: a depth-first
    search that combines two terms at a time, stopping after ``budget`` combinations (cheap for 4-5 numbers)."""
    left = [budget]

    def search(terms: list[tuple[Fraction, str]]) -> str | None:
        for i, (x, xs) in enumerate(terms):
            for j, (y, ys) in enumerate(terms):
                if i == j:
                    continue
                rest = [t for k, t in enumerate(terms) if k not in (i, j)]
                for fn, symbol, commutative in _COMBINE:
                    if (commutative and j < i) or (symbol == "/" and y == 0):
                        continue
                    left[0] -= 1
                    if left[0] < 0:
                        return None
                    value, text = fn(x, y), f"({xs} {symbol} {ys})"
                    if value == target:
                        return text[1:-1]
                    found = search(rest + [(value, text)]) if rest else None
                    if found:
                        return found
        return None

    if target in numbers:
        return str(target)
    return search([(Fraction(n), str(n)) for n in numbers])


ENV = PythonTool
