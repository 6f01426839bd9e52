"""The generate role's engine: an in-process vLLM ``LLM`` that takes token ids and new weights.

Contract with the trainer:
- prompts and completions are token ids (the engine starts with ``skip_tokenizer_init``);
- generation stops at the EOS ids of the checkpoint's generation_config.json (without a tokenizer vLLM
  knows no other EOS), plus ``stop_token_ids``; the stop token is the last of ``token_ids``;
- each completion carries the log-probability of every sampled token under the distribution it was
  sampled from (after temperature and top-p: vLLM's ``logprobs_mode="processed_logprobs"``);
- ``update_weights`` takes tensors in Hugging Face naming, loads them in place (vLLM's
  ``reload_weights`` with a weights iterator, which also redoes CPU repacking), drops the prefix cache
  and records ``version``.

Left out: async engines and request abort (see ``abort``), LoRA, multimodal inputs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Completion", "VllmGenerator"]


@dataclass
class Completion:
    token_ids: list[int]  # [T] generated tokens, prompt excluded
    logprobs: list[float]  # [T] log p(token_ids[t]) under the sampling distribution
    finish_reason: str  # "stop" (EOS / stop token) or "length" (max_tokens)
    version: int = field(default=-1)  # weights version that generated it


class VllmGenerator:
    """One vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Args:
        model_dir: Hugging Face checkpoint directory (config.json + safetensors); no tokenizer needed.
        seed: engine seed (default sampling stream when ``generate`` gets ``seed=None``).
        max_model_len: prompt + completion tokens per sequence.
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache (GPU only).
        cpu_kv_cache_bytes: KV cache size on CPU (``kv_cache_memory_bytes``; the byte-exact form of
            ``VLLM_CPU_KVCACHE_SPACE``, which is whole GiB and defaults to 4 GiB).
        enforce_eager: no torch.compile / CUDA graphs (fast start; the default for tests and CPU).
        tensor_parallel_size: >1 makes vLLM start worker processes; weights then travel pickled
            through vLLM's RPC queue, fine for small models only.
        dtype: "float32", "bfloat16", "auto", ...
        stop_token_ids: extra ids that end every completion (e.g. when the checkpoint has no
            generation_config.json, vLLM would otherwise never stop before ``max_tokens``).
    """

    def __init__(self, model_dir: str | os.PathLike, *, seed: int = 0, max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.5, cpu_kv_cache_bytes: int = 256 << 20,
                 enforce_eager: bool = True, tensor_parallel_size: int = 1, dtype: str = "auto",
                 stop_token_ids: Sequence[int] = (), **engine_kwargs: Any) -> None:
        # Engine core in this process (weights can then be handed over as live tensors). Must be set
        # before vllm is imported; so must VLLM_CONFIGURE_LOGGING=0 (vLLM logs through this process's
        # logging config instead of installing its own handlers).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.sleep_supported = current_platform.is_sleep_mode_available()
        memory = ({"kv_cache_memory_bytes": int(cpu_kv_cache_bytes)} if self.on_cpu
                  else {"gpu_memory_utilization": gpu_memory_utilization})
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, seed=seed, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                       logprobs_mode="processed_logprobs", enable_sleep_mode=self.sleep_supported,
                       **memory, **engine_kwargs)
        self.tensor_parallel_size = tensor_parallel_size
        self.stop_token_ids = list(stop_token_ids)
        self.version = 0
        self.asleep = False

    def generate(self, prompt_token_ids: list[list[int]], *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_tokens: int = 256, seed: int | None = None,
                 ignore_eos: bool = False) -> list[list[Completion]]:
        """``n`` completions per prompt, in prompt order.

        With ``seed`` set, prompt ``i`` samples from seed ``seed + i * n`` (vLLM gives its ``n``
        children ``+0 .. +n-1``), so every completion has its own stream and a call is reproducible.
        ``temperature=0`` is greedy; its logprobs are then the plain log-softmax of the logits.
        """
        from vllm import SamplingParams

        if self.asleep:
            raise RuntimeError("engine is asleep: call wake_up() first")
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                 seed=None if seed is None else seed + i * n, logprobs=0,
                                 ignore_eos=ignore_eos, stop_token_ids=self.stop_token_ids,
                                 detokenize=False)
                  for i in range(len(prompt_token_ids))]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[self._completion(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def _completion(self, out: Any) -> Completion:
        token_ids = list(out.token_ids)
        # logprobs=0 returns, per position, a dict holding just the sampled token's entry.
        logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, out.logprobs)]
        return Completion(token_ids, logprobs, str(out.finish_reason), self.version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors into the running engine; names may be any subset of the model's.

        Tensors are copied in (the caller may reuse its buffers afterwards). Cached prefixes were
        computed with the old weights, so the prefix cache is dropped.
        """
        if self.asleep:
            raise RuntimeError("engine is asleep: call wake_up() first")
        # The in-process executor calls the worker directly, so a lazy iterator is fine; worker
        # processes (TP > 1) need the list pickled.
        weights = named_tensors if self.tensor_parallel_size == 1 else list(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self.version = version

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (level 1: weights to host, KV cache dropped).

        vLLM has no sleep mode on CPU (its CPU worker ignores the call), so there this only marks the
        engine asleep and nothing is freed. After ``sleep(2)`` (weights discarded) call
        ``update_weights`` right after ``wake_up``.
        """
        if self.sleep_supported:
            self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self) -> None:
        if self.sleep_supported:
            self.llm.wake_up()
        self.asleep = False

    def abort(self, request_ids: Iterable[str]) -> None:
        """Not supported: the synchronous ``LLM.generate`` blocks until every request finishes, so no
        other caller in this thread can name a running request. Stopping early needs vLLM's
        ``AsyncLLM`` (``abort(request_id)``); bound the work with ``max_tokens`` instead."""
        raise NotImplementedError("VllmGenerator.generate is synchronous; requests cannot be aborted")
