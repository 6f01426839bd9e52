"""Free-form math answers scored with Hugging Face's math-verify: ``\\boxed{7/8}``, ``0.875`` and
``\\frac{7}{8}`` all match a reference of ``7/8``.

Why a library: once answers are fractions, decimals or LaTeX, a string comparison pays for formatting
and refuses right answers. math-verify extracts the answer (boxed first, then the last expression) and
compares it with sympy, under a time limit per parse and per comparison.

Threads: those time limits are ``signal.alarm``, which works only in a process's main thread; elsewhere
math-verify raises ValueError. So ``score_answers`` runs inline in the main thread (a worker rank's calls
run there) and, called from any other thread, sends the work to a small process pool whose workers
score in their own main threads. The pool's processes are started with ``spawn`` (forking a
multi-threaded process, such as an MPI rank with vLLM inside, is unsafe) on first use and replaced
whenever a batch misses its deadline, so a scorer stuck in C code (where the alarm cannot interrupt)
costs that batch its scores, never the caller's progress.

Left out: answers that need context (units, "x = 3 or x = -3" sets against a single value are refused
by math-verify's own rules), and multiple-choice letters.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing
import re
import threading
import time
from collections.abc import Sequence

__all__ = ["MAX_RESPONSE_CHARS", "score_answer", "score_answers", "shutdown_pool"]

# longer responses are cut to their last 4096 characters (the answer is at the end)
MAX_RESPONSE_CHARS = 4096
POOL_WORKERS = 2
# A number as written: 7, -0.875, .5, 7/8, 7 / 8, \frac{7}{8}, -\dfrac{3}{4}, 1\frac{1}{4} (mixed number).
_NUMBER = re.compile(
    r"-?\s*(?:(?:\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?|\d*\s*\\[dt]?frac\{-?\d+\}\{\d+\})"
)
_pool: cf.ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def score_answer(
    response: str, reference: str, *, number_only: bool = False, timeout_s: int = 5
) -> float:
    """1.0 when ``response``'s answer equals ``reference`` mathematically, else 0.0 (see ``score_answers``)."""
    return score_answers([(response, reference)], number_only=number_only, timeout_s=timeout_s)[0]


def score_answers(
    pairs: Sequence[tuple[str, str]],
    *,
    number_only: bool = False,
    timeout_s: int = 5,
    pool_deadline_s: float = 60.0,
) -> list[float]:
    """One score per ``(response, reference)``: inline in the main thread, else in the process pool.

    ``number_only``: the answer as math-verify extracted it must be written as one number (``7/8``,
    ``0.875``, ``\\frac{7}{8}``, ``-3``), not an expression: math-verify compares values, so a response that
    copies the question (``\\boxed{3/4 + 1/8}``) would otherwise be paid for the answer it never computed.
    ``timeout_s`` bounds each parse and each comparison (math-verify's own limits; a timeout scores 0).
    In the pool, the whole batch must be done within ``pool_deadline_s`` (it includes the pool's start,
    ~2 s the first time); unfinished pairs score 0.0 and the pool is replaced. A reference that
    math-verify cannot read is an error (ValueError), not a 0 for the policy.
    """
    if threading.current_thread() is threading.main_thread():
        return _score_batch_inline(list(pairs), number_only, timeout_s)
    return _score_in_pool(pairs, number_only, timeout_s, pool_deadline_s)


def _score_inline(response: str, reference: str, number_only: bool, timeout_s: int) -> float:
    """In a main thread only (math-verify's alarms). Errors and timeouts in the response score 0.0."""
    # imported here: math-verify loads sympy (~1 s), and tasks import this module at config load
    from math_verify import parse, verify

    gold = parse(reference, parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"math-verify cannot read the reference answer {reference!r}")
    answer = parse(response[-MAX_RESPONSE_CHARS:], parsing_timeout=timeout_s)
    if not answer or (number_only and not _NUMBER.fullmatch(str(answer[-1]).strip())):
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout_s) else 0.0


def _score_batch_inline(
    pairs: list[tuple[str, str]], number_only: bool, timeout_s: int
) -> list[float]:
    return [_score_inline(r, ref, number_only, timeout_s) for r, ref in pairs]


def _score_in_pool(
    pairs: Sequence[tuple[str, str]], number_only: bool, timeout_s: int, deadline_s: float
) -> list[float]:
    if not pairs:
        return []
    pool = _get_pool()
    chunk = max(1, -(-len(pairs) // POOL_WORKERS))
    futures = [
        pool.submit(_score_batch_inline, list(pairs[i : i + chunk]), number_only, timeout_s)
        for i in range(0, len(pairs), chunk)
    ]
    deadline = time.monotonic() + deadline_s
    scores: list[float] = []
    late = False
    for i, future in zip(range(0, len(pairs), chunk), futures):
        n = len(pairs[i : i + chunk])
        try:
            scores += future.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            late = True
            scores += [0.0] * n
    if late:
        shutdown_pool(kill=True)
    return scores


def _get_pool() -> cf.ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = cf.ProcessPoolExecutor(
                POOL_WORKERS, mp_context=multiprocessing.get_context("spawn")
            )
        return _pool


def shutdown_pool(kill: bool = False) -> None:
    """Stop the pool (if any); ``kill`` ends its processes at once (a stuck scorer never returns)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is None:
        return
    if kill:
        # no public API ends busy workers
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()
    pool.shutdown(wait=not kill, cancel_futures=True)


atexit.register(shutdown_pool)
