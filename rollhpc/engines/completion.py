"""What both generation engines (vLLM's, ``vllm_engine``; the plain-torch one, ``torch_engine``) hand back, and the
step API they share: the rollout scheduler and the generate role treat them alike, so the API is written once
here and each engine fills in what it runs on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["Completion", "InFlight", "Sampling", "StepEngine"]


class InFlight(Protocol):
    """What an engine keeps of a step-API request between ``add_request`` and its finish or abort."""

    token_ids: list[int]  # generated so far
    logprobs: list[float]
    version: int  # weights version live when it was added


@dataclass
class Completion:
    token_ids: list[int]  # [T] generated tokens, prompt excluded
    logprobs: list[float]  # [T] log p(token_ids[t]) under the sampling distribution
    finish_reason: str  # "stop" (EOS / stop token), "length" (max_tokens) or "abort" (a partial)
    version: int = field(default=-1)  # weights version that generated it
    # MoE routing (routing replay r3: rollhpc.workers.router_replay): int16 [fed, moe_layers, top_k], the experts
    # each token fed to the model (the prompt's and every sampled one but the last: fed = prompt + T - 1) was
    # routed to in each MoE layer, as global expert ids; None: a dense model, or an engine that records none
    routes: np.ndarray | None = None

    @classmethod
    def of(cls, request: InFlight, finish_reason: str) -> Completion:
        """A request's tokens so far as a completion, under the weights version it was added with (and the routes
        of its tokens when the engine keeps them: ``routes`` on the request)."""
        routes = getattr(request, "routes", None)
        return cls(request.token_ids, request.logprobs, finish_reason, request.version, routes)


@dataclass(frozen=True)
class Sampling:
    """How one request samples: the keyword arguments of ``generate`` and ``add_request``."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None  # None: the engine's own stream
    ignore_eos: bool = False


R = TypeVar("R", bound=InFlight)


class StepEngine(Generic[R]):
    """The API both engines serve: batch ``generate``, the step API (``add_request``, ``step``, ``abort``; the
    loop ``run_until``), ``update_weights`` and ``sleep`` / ``wake_up``, with the checks before each call: the
    engine awake (``asleep``: its KV cache released; ``weights_asleep``: its weights too) and, where a call would
    mix or drop requests, none in flight. An engine fills in the underscored hooks and ``step``."""

    asleep: bool = False  # no generation until the KV cache is back
    weights_asleep: bool = False  # no weight update until the weights are back
    # whether sleep() frees memory (else it only marks the engine asleep)
    sleep_supported: bool = False
    version: int = 0  # the weights version live now
    _live: dict[str, R]  # step-API requests in flight, by caller id, in add order

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[list[Completion]]:
        """``n`` completions per prompt, in prompt order; with ``seed`` set every completion samples from a
        stream of its own and a call is reproducible (each engine's ``_generate`` says which streams).
        ``temperature=0`` is greedy. Refused while step-API requests are in flight."""
        self._check_idle("generate()")
        sampling = Sampling(float(temperature), float(top_p), max_tokens, seed, ignore_eos)
        return self._generate(prompt_token_ids, n, sampling)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> None:
        """Queue one completion of ``prompt_token_ids``; it starts at a next ``step``.

        The weights version live now is recorded with the request and reported by its completion:
        the completion belongs to the weights that sampled it, whenever the caller collects it.
        """
        sampling = Sampling(float(temperature), float(top_p), max_tokens, seed, ignore_eos)
        self._enqueue(request_id, list(prompt_token_ids), sampling)

    def step(self) -> list[tuple[str, Completion]]:
        """One engine step; the requests that finished in it, with all their tokens."""
        raise NotImplementedError

    def abort(self, request_ids: Iterable[str]) -> list[tuple[str, Completion]]:
        """Stop the named requests still in flight; return each one's partial completion.

        A partial has the tokens and logprobs generated so far and ``finish_reason="abort"``; the
        caller may resume it with prompt + partial tokens. Unknown or finished ids are ignored.
        """
        if isinstance(request_ids, str):
            raise TypeError("abort() takes a collection of ids, not one id string")
        aborted = [
            (rid, self._live.pop(rid)) for rid in dict.fromkeys(request_ids) if rid in self._live
        ]
        if aborted:
            self._stop([request for _, request in aborted])
        return [(rid, Completion.of(request, "abort")) for rid, request in aborted]

    def num_unfinished(self) -> int:
        return len(self._live)

    def unfinished_ids(self) -> list[str]:
        return list(self._live)

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

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load Hugging Face-named tensors into the engine and record ``version`` (what each engine takes:
        its ``_load_weights``). Refused while the weights are asleep, and while step-API requests are in
        flight: their tokens would mix two versions under one recorded version (abort them first; the
        partials resume under the new weights)."""
        if self.weights_asleep:
            raise RuntimeError(
                "update_weights() while the engine's weights are asleep: wake_up(['weights']) first"
            )
        self._check_idle("update_weights()", generating=False)
        self._load_weights(named_tensors)
        self.version = version

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (level 1: weights to host, KV cache dropped; after level 2,
        weights discarded, call ``update_weights`` right after ``wake_up``). Where the engine has no sleep
        mode (``sleep_supported``) this only marks it asleep. Refused while step-API requests are in flight."""
        self._check_idle("sleep()", generating=False)
        self._release_memory(level)
        self.asleep = self.weights_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake all of it, or only ``tags`` ("weights", "kv_cache"): a weight sync needs the weights back,
        not yet the KV cache (which then still leaves its memory to the trainer)."""
        self._restore_memory(tags)
        if tags is None or "weights" in tags:
            self.weights_asleep = False
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    # what an engine fills in

    def _generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling
    ) -> list[list[Completion]]:
        raise NotImplementedError

    def _start(self, request_id: str, prompt_token_ids: list[int], sampling: Sampling) -> R:
        """Hand one request to the engine; what is kept of it while it is in flight."""
        raise NotImplementedError

    def _stop(self, requests: list[R]) -> None:
        """Stop requests already taken out of ``_live`` (an abort)."""
        raise NotImplementedError

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _release_memory(self, level: int) -> None:
        """Sleep's work where the engine frees memory; nothing by default."""

    def _restore_memory(self, tags: list[str] | None) -> None:
        """Wake-up's work where the engine freed memory; nothing by default."""

    # checks

    def _enqueue(self, request_id: str, prompt_token_ids: list[int], sampling: Sampling) -> None:
        self._check_awake()
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already in flight")
        self._live[request_id] = self._start(request_id, prompt_token_ids, sampling)

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
