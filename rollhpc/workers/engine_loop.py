"""The generate role's engine, stepped in a thread of its own between the rollout scheduler's calls.

Why: when a call steps the engine only until a request finishes, the engine stands still from that
return until the next call arrives: the reply's trip to the controller, the scoring hop the controller
starts, and the next call's trip back. With short responses that is a third of the generator's time
(tests/ and bench/ profiles of the quickstart). Here the engine keeps stepping while the controller works;
a call hands over its new requests and aborts and collects what finished meanwhile.

The protocol of a call is the one ``drive_engine`` has (``rollhpc.workers.vllm_generate``): aborts, then adds,
then the completions that finished, at least one when any request is still running (waiting up to
``max_wait_s`` for it), and the partials of the aborted requests (an abort is always answered in its own call).
Only this thread touches the engine while requests run; the role's other engine calls (weight updates,
batch generation, sleep) take ``lock`` and run when no request is in flight, as the scheduler guarantees.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from rollhpc.engines.completion import Completion, StepEngine
from rollhpc.rollout.ports import GenerationReply, GenerationRequest

log = logging.getLogger("rollhpc.engine_loop")


class EngineLoop:
    """Steps a ``VllmGenerator`` (step API) whenever it has requests; ``call`` is the scheduler's port."""

    def __init__(
        self, engine: StepEngine, *, temperature: float, top_p: float, ignore_eos: bool = False
    ):
        self.engine = engine
        self.sampling = {"temperature": temperature, "top_p": top_p, "ignore_eos": ignore_eos}
        self.lock = threading.RLock()  # held whenever the engine is in use
        self._cond = threading.Condition()
        self._adds: list[GenerationRequest] = []
        self._aborts: list[str] = []
        # abort batches handed over, and the last one the loop has carried out
        self._abort_ticket = 0
        self._aborts_done = 0
        self._finished: list[tuple[str, Completion]] = []
        self._aborted: list[tuple[str, Completion]] = []
        self._busy_s = 0.0
        self._running = 0  # requests in the engine after the loop's last step
        self._error: BaseException | None = None
        self._closed = False
        # OpenMP's thread count is per thread: a new thread may start from the process default (OMP_NUM_THREADS)
        # rather than the count the role set, and vLLM's CPU attention checks that its plan and its kernel see
        # the same count, so the loop takes the caller's (through torch's own binding: vLLM's CPU backend
        # replaces torch.set_num_threads with a no-op once it has bound its threads)
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def call(
        self, adds: list[GenerationRequest], aborts: list[str], max_wait_s: float
    ) -> GenerationReply:
        """Hand over ``adds`` and ``aborts``; return what finished and was aborted since the last call."""
        with self._cond:
            self._check()
            self._adds += adds
            ticket = self._aborts_done
            if aborts:
                self._aborts += aborts
                self._abort_ticket += 1
                ticket = self._abort_ticket
            self._cond.notify_all()
            deadline = time.monotonic() + max_wait_s
            while True:
                self._check()
                # an abort is answered by the call that asked for it
                if self._aborts_done >= ticket:
                    idle = not (self._adds or self._aborts or self._running)
                    if self._finished or idle or time.monotonic() >= deadline:
                        break
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.001))
            out = GenerationReply(self._finished, self._aborted, self._busy_s)
            self._finished, self._aborted, self._busy_s = [], [], 0.0
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine loop failed: {self._error!r}") from self._error
        if not self._thread.is_alive():
            raise RuntimeError("the engine loop has stopped (closed, or its thread died)")

    def _run(self) -> None:
        try:
            torch._C.set_num_threads(self._threads)
            while True:
                with self._cond:
                    while not (self._adds or self._aborts or self._running or self._closed):
                        self._cond.wait()
                    if self._closed:
                        return
                    adds, aborts, ticket = self._adds, self._aborts, self._abort_ticket
                    self._adds, self._aborts = [], []
                    # the taken requests count as running from now on: until the step below reports the
                    # engine's own count, a call would otherwise see no work left and return at once, and the
                    # scheduler's calls would spin, holding the GIL this thread needs between torch ops
                    self._running += len(adds)
                with self.lock:
                    aborted = self.engine.abort(aborts) if aborts else []
                    for r in adds:
                        self.engine.add_request(
                            r.id,
                            r.prompt,
                            max_tokens=r.max_tokens,
                            seed=r.seed,
                            **sampling(r, **self.sampling),
                        )
                    t = time.perf_counter()
                    finished = self.engine.step() if self.engine.num_unfinished() else []
                    busy = time.perf_counter() - t
                    running = self.engine.num_unfinished()
                with self._cond:
                    self._finished += finished
                    self._aborted += aborted
                    self._busy_s += busy
                    self._running = running
                    self._aborts_done = ticket
                    self._cond.notify_all()
        except BaseException as e:  # reported by the next call, on the caller's side
            log.exception("engine loop failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()


def sampling(
    request: GenerationRequest, *, temperature: float, top_p: float, ignore_eos: bool = False
) -> dict[str, Any]:
    """A request's sampling settings: the role's, unless the request names a temperature (greedy evaluation
    runs through the same loop); a greedy request takes the whole distribution (top-p 1), as batch generation
    does, so its log-probs are the plain log-softmax."""
    if request.temperature is None:
        return {"temperature": temperature, "top_p": top_p, "ignore_eos": ignore_eos}
    t = request.temperature
    return {"temperature": t, "top_p": top_p if t > 0 else 1.0, "ignore_eos": ignore_eos}
