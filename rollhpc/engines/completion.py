"""What both generation engines (vLLM's, ``vllm_engine``; the plain-torch one, ``torch_engine``) hand back, and the
step loop they share: the rollout scheduler and the generate role treat them alike, so their step API must
not drift apart."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Completion", "StepEngine"]


@dataclass
class Completion:
    token_ids: list[int]  # [T] generated tokens, prompt excluded
    logprobs: list[float]  # [T] log p(token_ids[t]) under the sampling distribution
    finish_reason: str  # "stop" (EOS / stop token), "length" (max_tokens) or "abort" (a partial)
    version: int = field(default=-1)  # weights version that generated it


class StepEngine:
    """The step API's loop over an engine's ``step`` (one decoding step of every live request, returning the
    ``(request id, Completion)`` of those that finished) and ``num_unfinished``, and the checks before a call
    that needs the engine awake (``asleep``: its KV cache released) or without requests in flight."""

    asleep: bool = False

    def step(self) -> list[tuple[str, Completion]]:
        raise NotImplementedError

    def num_unfinished(self) -> int:
        raise NotImplementedError

    def run_until(
        self, min_finished: int = 1, max_steps: int | None = None
    ) -> list[tuple[str, Completion]]:
        """Step until ``min_finished`` requests finished, none is left, or ``max_steps`` steps ran."""
        finished: list[tuple[str, Completion]] = []
        steps = 0
        while (
            self.num_unfinished()
            and len(finished) < min_finished
            and (max_steps is None or steps < max_steps)
        ):
            finished += self.step()
            steps += 1
        return finished

    def _check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError("engine is asleep: call wake_up() first")

    def _check_idle(self, what: str, generating: bool = True) -> None:
        if generating:
            self._check_awake()
        if self.num_unfinished():
            raise RuntimeError(
                f"{what} with {self.num_unfinished()} step-API requests in flight: "
                "finish them (step/run_until) or abort them first"
            )
