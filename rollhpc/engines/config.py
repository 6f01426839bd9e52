"""The options of a role that owns a generation engine (generate, judge), and the one place they build it.

Kept apart from the engines so that config validation imports neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rollhpc.engines.vllm_choices import AutoBool, EngineProcess, resolve_vllm_choices

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
    # vllm, GPU speed ("auto": by platform, resolve_vllm_choices; the engine logs what it chose):
    # enforce_eager: true skips torch.compile and CUDA graphs. auto: true on CPU (vLLM compiles the model with
    # inductor there, a C++ build at every start: 13 s on a cold cache for the sampler's one small op alone), false
    # on GPU (CUDA graphs: a decode step of a small batch is mostly kernel launches)
    enforce_eager: AutoBool = "auto"
    # seeded_sampling: false drops the per-request seeds the rollout scheduler gives (samples then come from the
    # engine's own stream, seeded by run.seed + rank, and are not reproducible request by request). auto: true on
    # CPU (exact resume and the reproducibility tests rely on it), false on GPU, where generation is not bit-exact
    # anyway (kernels vary with batch shape) and vLLM's V1 model runner draws each seeded request's noise in a
    # Python loop, one kernel per request per step (vllm/v1/sample/ops/topk_topp_sampler.py: random_sample); its
    # V2 runner hashes (seed, position) in one kernel instead (vllm/v1/worker/gpu/sample/gumbel.py)
    seeded_sampling: AutoBool = "auto"
    # engine_process: "separate" runs vLLM's engine core (scheduler, model, sampler) in a process of its own, so the
    # serving loop's Python (replies, the scheduler's calls) never waits on its GIL; weight updates then take
    # vLLM's weight-transfer protocol (as at TP > 1; its CUDA-IPC handles reach the engine core only pickled, so the
    # engine sets VLLM_ALLOW_INSECURE_SERIALIZATION=1 for its own child). "same": in this process (weights handed
    # over as live tensors). auto: same on CPU, separate on GPU
    engine_process: EngineProcess = "auto"
    # vllm: every completion carries its tokens' routed experts (routing replay r3): a MoE model on a GPU (vLLM's
    # enable_return_routed_experts, prefix caching on). engine=torch returns them for MoE models anyway
    return_routes: bool = False

    def __post_init__(self) -> None:
        if (
            self.max_model_len < 1
            or self.cpu_kv_cache_mb < 1
            or self.tensor_parallel_size < 1
            or self.threads < 0
        ):
            raise ValueError(
                "need max_model_len >= 1, cpu_kv_cache_mb >= 1, tensor_parallel_size >= 1, threads >= 0"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_lora_rank not in VLLM_LORA_RANKS + (0,):
            raise ValueError(
                f"max_lora_rank must be 0 (no LoRA serving) or one of vLLM's {VLLM_LORA_RANKS}, got "
                f"{self.max_lora_rank}"
            )
        if self.engine == "torch" and self.max_lora_rank:
            raise ValueError(
                "max_lora_rank is vLLM's LoRA serving; engine=torch merges a LoRA trainer's adapters "
                "itself: leave it 0"
            )
        if self.engine == "torch" and self.tensor_parallel_size != 1:
            raise ValueError(
                f"engine=torch runs on one device; tensor_parallel_size={self.tensor_parallel_size} "
                "needs engine=vllm"
            )
        self._check_vllm_speed_options()

    def _check_vllm_speed_options(self) -> None:
        """The vLLM speed options hold one of their values (also when built in Python, not loaded), and name no
        behaviour engine=torch does not have: an option that silently does nothing would mislead."""
        resolve_vllm_choices(True, self.enforce_eager, self.seeded_sampling, self.engine_process)
        if self.engine != "torch":
            return
        forced = {"enforce_eager": self.enforce_eager, "engine_process": self.engine_process}
        for key, value in forced.items():
            if value != "auto":
                raise ValueError(
                    f"{key}={value!r} is a vLLM option; engine=torch runs eagerly in this process: "
                    "leave it 'auto'"
                )
        if self.seeded_sampling is False:
            raise ValueError(
                "seeded_sampling=false is a vLLM option; engine=torch always samples a seeded request "
                "from its own stream: leave it 'auto'"
            )

    def build_engine(
        self, model_dir: str, seed: int, **kwargs: object
    ) -> VllmGenerator | TorchGenerator:
        """The engine on ``model_dir`` with these options (``kwargs``: its other arguments)."""
        import torch  # the engines' imports are heavy: config validation imports none of them

        if self.threads:
            torch.set_num_threads(self.threads)
        common = dict(
            seed=seed,
            max_model_len=self.max_model_len,
            cpu_kv_cache_bytes=self.cpu_kv_cache_mb << 20,
            dtype=self.dtype,
            **kwargs,
        )
        if self.engine == "torch":
            from rollhpc.engines.torch_engine import TorchGenerator

            return TorchGenerator(model_dir, **common)
        from rollhpc.engines.vllm_engine import VllmGenerator

        return VllmGenerator(
            model_dir,
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=self.tensor_parallel_size,
            max_lora_rank=self.max_lora_rank,
            enforce_eager=self.enforce_eager,
            seeded_sampling=self.seeded_sampling,
            engine_process=self.engine_process,
            return_routes=self.return_routes,
            **common,
        )

    def returns_routes(self) -> bool:
        """Whether this engine returns the experts each token was routed to (routing replay r3): the torch engine
        does for its MoE models (``Completion.routes``), vLLM with ``return_routes`` (on a GPU)."""
        return self.engine == "torch" or self.return_routes

    def takes_adapters(self) -> bool:
        """Whether this engine takes a LoRA trainer's adapters alone (and serves or merges them itself)."""
        return self.engine == "torch" or self.max_lora_rank > 0
