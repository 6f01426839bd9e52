"""The options of a role that owns a vLLM engine (generate, judge), and the one place they build it.

Kept apart from ``vllm_engine`` so that config validation imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rollhpc.engines.vllm_engine import VllmGenerator

__all__ = ["EngineOptions"]


@dataclass(kw_only=True)
class EngineOptions:
    max_model_len: int = 512
    cpu_kv_cache_mb: int = 256  # KV cache on CPU
    gpu_memory_utilization: float = 0.5  # on GPU (leave room for colocated roles)
    tensor_parallel_size: int = 1  # vLLM's own TP (gpus_per_proc of the role should match)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int = 0  # torch intra-op threads on CPU (0: leave the default)

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.cpu_kv_cache_mb < 1 or self.tensor_parallel_size < 1 or self.threads < 0:
            raise ValueError("need max_model_len >= 1, cpu_kv_cache_mb >= 1, tensor_parallel_size >= 1, threads >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def build_engine(self, model_dir: str, seed: int, **kwargs: Any) -> VllmGenerator:
        """A ``VllmGenerator`` on ``model_dir`` with these options (``kwargs``: its other arguments)."""
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        from rollhpc.engines.vllm_engine import VllmGenerator

        return VllmGenerator(model_dir, seed=seed, max_model_len=self.max_model_len,
                             cpu_kv_cache_bytes=self.cpu_kv_cache_mb << 20,
                             gpu_memory_utilization=self.gpu_memory_utilization,
                             tensor_parallel_size=self.tensor_parallel_size, dtype=self.dtype, **kwargs)
