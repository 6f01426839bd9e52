"""Generate role: one engine per rank (vLLM, or ``engine: torch`` for tiny models: rollhpc.engines.torch_engine),
driven request by request by the rollout scheduler.

``rollout`` is the scheduler's one call: it hands new requests and aborts to the engine, which steps in a
thread of its own (``rollhpc.workers.engine_loop``: it does not stand still while a reply travels to the
controller and the next call comes back), and returns what finished since the last call, waiting for at
least one completion while requests run (at most ``max_wait_s``, so new work and aborts are never held up
for long). Continuous batching carries on across calls. ``generate`` is the batch path (evaluation,
baselines).
Weights arrive as Hugging Face-named buckets with a version; every completion records the version that
was live when its request started.
"""

from __future__ import annotations

import time

from rollhpc.engines.completion import Completion, StepEngine
from rollhpc.protocol.worker import Worker, WorkerContext
from rollhpc.rollout.ports import GenerationReply, GenerationRequest
from rollhpc.weight_sync.broadcast import WeightBroadcast
from rollhpc.weight_sync.buckets import Bucket, verified
from rollhpc.weight_sync.slots import SlotReceiver, StoreControl, connect_store
from rollhpc.workers.engine_loop import EngineLoop, sampling
from rollhpc.workers.offload import gpu_memory
from rollhpc.workers.vllm_generate_spec import VllmGenerateWorkerSpec


class VllmGenerateWorker(VllmGenerateWorkerSpec, Worker):
    """The engine, its stepping thread and its weight receivers (``Options`` and the memory estimates: its spec,
    vllm_generate_spec)."""

    def __init__(self, ctx: WorkerContext, options: VllmGenerateWorkerSpec.Options):
        super().__init__(ctx, options)
        self.engine = options.build_engine(options.model_dir, seed=ctx.seed + ctx.group_rank)
        self.loop = EngineLoop(self.engine, temperature=options.temperature, top_p=options.top_p)

    def offload_states(self, parts: list[str]) -> dict[str, float]:
        """Sleep (rollhpc.controller.colocation): vLLM's level 1 takes ``parts`` together whatever they are (the
        KV cache dropped, the weights to host memory; ``offloads_whole``); returns seconds and this process's
        GPU memory after."""
        t = time.perf_counter()
        with self.loop.lock:
            if not (self.engine.asleep and self.engine.weights_asleep):
                self.engine.sleep(level=1)
        return {"seconds": time.perf_counter() - t, **gpu_memory()}

    def reload_states(self, parts: list[str]) -> dict[str, float]:
        """Wake ``parts`` ("weights", "kv_cache"): a weight sync needs only the weights back."""
        t = time.perf_counter()
        with self.loop.lock:
            self.engine.wake_up(tags=sorted(parts))
        return {"seconds": time.perf_counter() - t, **gpu_memory()}

    def update_weights(self, buckets: list[Bucket], version: int) -> float:
        """Load the trainer's bucketed weights in place; returns the seconds it took."""
        t = time.perf_counter()
        with self.loop.lock:
            self.engine.update_weights(
                (item for b in buckets for item in verified(b, f"to version {version}")), version
            )
        return time.perf_counter() - t

    def join_weight_channel(
        self, address: tuple[str, int], world: int, member: int | None = None
    ) -> None:
        """Join the trainer's broadcast group as rank ``member`` (default 1 + group rank: every generator is in
        it; a routed sync names the members, see ``weight_sync.routing``)."""
        rank = 1 + self.ctx.group_rank if member is None else member
        self._channel = WeightBroadcast(rank, world, address[0], address[1])

    def receive_weights(self, version: int) -> float:
        """Take the trainer's broadcast straight into the engine; returns the seconds it took."""
        t = time.perf_counter()
        with self.loop.lock:
            self.engine.update_weights(self._channel.receive(), version)
        return time.perf_counter() - t

    def receive_shared_weights(
        self, address: tuple[str, int], tag: str, version: int, member: int | None = None
    ) -> float:
        """Take the weights the colocated trainer streams through its slots (``weight_sync.slots``: CUDA IPC on a
        GPU, shared memory on the CPU, as its headers say) into the engine: each bucket is copied out of the
        trainer's slot into memory of this process's own and acknowledged (the trainer then refills that slot)
        before the engine loads it. ``member``: this rank's number among the trainer's receivers (default: group
        rank). Returns the seconds it took. On any failure the trainer is told, so neither end waits."""
        t = time.perf_counter()
        if getattr(self, "_slot_store", None) is None or self._slot_store[0] != tuple(address):
            self._slot_store = (tuple(address), connect_store(address[0], address[1]))
        receiver = SlotReceiver(
            None,
            StoreControl(self._slot_store[1], tag),
            self.ctx.group_rank if member is None else member,
            f"to version {version}",
        )
        with self.loop.lock:
            try:
                self.engine.update_weights(receiver.stream(), version)
                receiver.finish()
            except BaseException as e:
                receiver.abort(e)
                raise
        return time.perf_counter() - t

    def rollout(self, adds: list[GenerationRequest], aborts: list[str]) -> GenerationReply:
        """Called on one rank at a time (``group.at(i).rollout``) by the rollout scheduler."""
        return self.loop.call(adds, aborts, self.options.max_wait_s)

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_tokens: int = 64,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """Batch generation (every request to the end): evaluation and batch-barrier baselines."""
        t = self.options.temperature if temperature is None else temperature
        with self.loop.lock:
            return self.engine.generate(
                prompts,
                n=n,
                temperature=t,
                top_p=self.options.top_p if t > 0 else 1.0,
                max_tokens=max_tokens,
                seed=seed,
            )

    def close(self) -> None:
        self.loop.close()
        self.engine = None


def drive_engine(
    engine: StepEngine,
    adds: list[GenerationRequest],
    aborts: list[str],
    *,
    temperature: float,
    top_p: float,
    max_wait_s: float,
    ignore_eos: bool = False,
) -> GenerationReply:
    """One scheduler call on a ``VllmGenerator`` stepped by the caller (benchmarks, probes): abort, add, then
    step until a request finishes or ``max_wait_s`` passes. ``busy_s`` is the time spent inside engine steps
    (the rest is idle). The role itself steps its engine in a thread of its own (``EngineLoop``)."""
    aborted = engine.abort(aborts) if aborts else []
    for r in adds:
        engine.add_request(
            r.id,
            r.prompt,
            max_tokens=r.max_tokens,
            seed=r.seed,
            **sampling(r, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos),
        )
    finished: list[tuple[str, Completion]] = []
    busy = 0.0
    deadline = time.perf_counter() + max_wait_s
    while engine.num_unfinished() and not finished:
        t = time.perf_counter()
        finished += engine.step()
        busy += time.perf_counter() - t
        if t > deadline:
            break
    return GenerationReply(finished, aborted, busy)
