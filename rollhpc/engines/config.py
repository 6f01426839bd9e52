"""The options of a role that owns a generation engine (generate, judge), and the one place they build it.

Kept apart from the engines so that config validation imports neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rollhpc.engines.torch_engine import TorchGenerator
    from rollhpc.engines.vllm_engine import VllmGenerator

__all__ = ["EngineConfig", "VLLM_LORA_RANKS"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


@dataclass(kw_only=True)
class EngineConfig:
    # vllm: the default, for models of any size. torch: rollhpc.engines.torch_engine, a plain-torch engine for
    # small dense Qwen2/Llama models, where vLLM's per-step bookkeeping is most of a step (CPU runs of the
    # tiny task models: bench/README.md has the numbers); its sampling streams differ from vLLM's
    engine: Literal["vllm", "torch"] = "vllm"
    max_model_len: int = 512
    cpu_kv_cache_mb: int = 256  # KV cache on CPU
    gpu_memory_utilization: float = 0.5  # on GPU (leave room for colocated roles)
    tensor_parallel_size: int = 1  # vLLM's own TP (gpus_per_proc of the role should match)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int = 0  # torch intra-op threads on CPU (0: leave the default)
    # vllm: > 0 serves a LoRA trainer's adapters (up to this rank) with vLLM's own LoRA, and weight syncs move the
    # adapters alone; 0: a LoRA trainer sends its base with the adapters merged in. (engine=torch always takes
    # the adapters alone and merges them.) One of VLLM_LORA_RANKS. Merged is the default by measurement: on CPU
    # vLLM's LoRA kernels made generation 3.6x slower (bench/results/lora_serving.json)
    max_lora_rank: int = 0

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.cpu_kv_cache_mb < 1 or self.tensor_parallel_size < 1 or self.threads < 0:
            raise ValueError("need max_model_len >= 1, cpu_kv_cache_mb >= 1, tensor_parallel_size >= 1, threads >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_lora_rank not in VLLM_LORA_RANKS + (0,):
            raise ValueError(f"max_lora_rank must be 0 (no LoRA serving) or one of vLLM's {VLLM_LORA_RANKS}, got "
                             f"{self.max_lora_rank}")
        if self.engine == "torch" and self.max_lora_rank:
            raise ValueError("max_lora_rank is vLLM's LoRA serving; engine=torch merges a LoRA trainer's adapters "
                             "itself: leave it 0")
        if self.engine == "torch" and self.tensor_parallel_size != 1:
            raise ValueError(f"engine=torch runs on one device; tensor_parallel_size={self.tensor_parallel_size} "
                             "needs engine=vllm")

    def build_engine(self, model_dir: str, seed: int, **kwargs: Any) -> VllmGenerator | TorchGenerator:
        """The engine on ``model_dir`` with these options (``kwargs``: its other arguments)."""
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        if self.engine == "torch":
            from rollhpc.engines.torch_engine import TorchGenerator

            return TorchGenerator(model_dir, seed=seed, max_model_len=self.max_model_len,
                                  cpu_kv_cache_bytes=self.cpu_kv_cache_mb << 20, dtype=self.dtype, **kwargs)
        from rollhpc.engines.vllm_engine import VllmGenerator

        return VllmGenerator(model_dir, seed=seed, max_model_len=self.max_model_len,
                             cpu_kv_cache_bytes=self.cpu_kv_cache_mb << 20,
                             gpu_memory_utilization=self.gpu_memory_utilization,
                             tensor_parallel_size=self.tensor_parallel_size, dtype=self.dtype,
                             max_lora_rank=self.max_lora_rank, **kwargs)

    def takes_adapters(self) -> bool:
        """Whether this engine takes a LoRA trainer's adapters alone (and serves or merges them itself)."""
        return self.engine == "torch" or self.max_lora_rank > 0
