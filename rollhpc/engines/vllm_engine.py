"""The generate role's engine: a vLLM ``LLM`` driven from this process that takes token ids and new weights.

Contract with the trainer:
- prompts and completions are token ids (the engine starts with ``skip_tokenizer_init``);
- generation stops at the EOS ids of the checkpoint's generation_config.json (without a tokenizer vLLM
  knows no other EOS), plus ``stop_token_ids``; the stop token is the last of ``token_ids``;
- each completion carries the log-probability of every sampled token under the distribution it was
  sampled from (after temperature and top-p: vLLM's ``logprobs_mode="processed_logprobs"``);
- ``update_weights`` takes tensors in Hugging Face naming, loads them in place (vLLM's
  ``reload_weights`` with a weights iterator, which also redoes CPU repacking; with TP > 1 vLLM's
  weight-transfer protocol, see ``vllm_weight_transfer``), drops the prefix cache and records ``version``;
- a rollout scheduler that works sample by sample uses the step API instead of ``generate``:
  ``add_request`` one prompt at a time, ``step`` to get the requests that finished in that engine step,
  ``abort`` to stop requests and keep their partial tokens (a later request resumes from them).

Start-up cost (it is on the critical path of every restart): the engine's heap of imported objects is
frozen before the engine is built, and on CPU the sampler's token-rank count runs eagerly instead of being
compiled at the first step (both in ``vllm_startup``, with the rest this process sets before an engine starts).

LoRA (``max_lora_rank`` > 0): the engine serves its base weights plus a LoRA trainer's adapters through vLLM's
own LoRA support (``enable_lora``); ``update_weights`` then takes the adapters alone (``MODULE.lora_A.weight``,
``MODULE.lora_B.weight`` with alpha/r in B: ``rollhpc.models.lora.adapter_sync_tensors``), writes them as a PEFT
directory in this process's scratch space (``vllm_lora``) and has vLLM load it in place of the previous version.

GPU speed (``rollhpc.engines.vllm_choices``, each "auto" by platform, logged at start): CUDA graphs
and torch.compile (``enforce_eager`` false), requests without per-request seeds (``seeded_sampling`` false), and
vLLM's engine core in a process of its own (``engine_process``: "separate"), so that this process's Python (the
serving loop, replies to the controller) and the engine's scheduling and sampling do not take turns on one GIL.
With a separate engine core every weight update takes vLLM's weight-transfer protocol, as at TP > 1 (the worker
is in another process: a lazy iterator of live tensors cannot reach it), and messages that vLLM's msgpack channel
carries only pickled (CUDA-IPC handles) are allowed for it (``vllm_startup.engine_core_takes_pickles``). The CPU
keeps eager, seeded, one process.

Left out: async engines (one thread drives the step API of the synchronous engine), multimodal inputs.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

# Before vLLM is first imported: it then logs through this process's logging config instead of installing its
# own handlers.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.logprobs import SampleLogprobs  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.outputs import CompletionOutput  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.renderers.inputs.preprocess import parse_model_prompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from rollhpc.engines import vllm_weight_transfer  # noqa: E402
from rollhpc.engines.completion import Completion, Sampling, StepEngine  # noqa: E402
from rollhpc.engines.vllm_choices import (  # noqa: E402
    AutoBool,
    EngineProcess,
    VllmChoices,
    resolve_vllm_choices,
)
from rollhpc.engines.vllm_cpu_moe_repack import (  # noqa: E402
    capture_expert0_gates,
    is_moe_config,
    repack_after_reload,
)
from rollhpc.engines.vllm_lora import AdapterSlot  # noqa: E402
from rollhpc.engines.vllm_startup import (  # noqa: E402
    engine_core_takes_pickles,
    let_engine_core_unpickle,
    log_choices,
    prepare_process,
)

__all__ = ["VllmGenerator"]

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """A step-API request between ``add_request`` and its finish or abort."""

    engine_id: str  # vLLM's internal id (the caller's id plus a random suffix)
    version: int  # weights version live when it was added
    token_ids: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[float] = field(default_factory=list)
    # int16 [fed, moe_layers, top_k] with return_routes, set when it finishes (vLLM hands routes over then)
    routes: np.ndarray | None = None


class VllmGenerator(StepEngine[_Live]):
    """One vLLM engine, its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or in its own.

    Args:
        model_dir: Hugging Face checkpoint directory (config.json + safetensors); no tokenizer needed.
        seed: engine seed (default sampling stream when ``generate`` gets ``seed=None``).
        max_model_len: prompt + completion tokens per sequence.
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache (GPU only).
        cpu_kv_cache_bytes: KV cache size on CPU (``kv_cache_memory_bytes``; the byte-exact form of
            ``VLLM_CPU_KVCACHE_SPACE``, which is whole GiB and defaults to 4 GiB).
        enforce_eager: no torch.compile / CUDA graphs (fast start); "auto": on CPU only.
        tensor_parallel_size: >1 makes vLLM start worker processes; weights then reach them through
            vLLM's weight-transfer protocol (shared memory on CPU, CUDA IPC on GPU:
            rollhpc.engines.vllm_weight_transfer), in chunks of ``weight_chunk_bytes``.
        dtype: "float32", "bfloat16", "auto", ...
        stop_token_ids: extra ids that end every completion (e.g. when the checkpoint has no
            generation_config.json, vLLM would otherwise never stop before ``max_tokens``).
        max_lora_rank: > 0: serve a LoRA trainer's adapters of up to this rank (vLLM's ``enable_lora``, one
            adapter); its weight updates are then the adapters alone.
        seeded_sampling: keep the seeds requests carry (False: every request samples from the engine's stream);
            "auto": on CPU only.
        engine_process: "same" / "separate": vLLM's engine core in this process or in one of its own (one value
            per process: vLLM caches its environment once an engine core runs here); "auto": separate on GPU.
        return_routes: each completion carries the experts every token it fed was routed to (``Completion.routes``,
            routing replay r3), through vLLM's ``enable_return_routed_experts``: a MoE model on a GPU (vLLM collects
            them in its Model Runner V2 only, with prefix caching, which this turns on; not with vLLM's PP).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        seed: int = 0,
        max_model_len: int = 1024,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_bytes: int = 256 << 20,
        enforce_eager: AutoBool = "auto",
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        stop_token_ids: Sequence[int] = (),
        weight_chunk_bytes: int = 256 << 20,
        max_lora_rank: int = 0,
        seeded_sampling: AutoBool = "auto",
        engine_process: EngineProcess = "auto",
        return_routes: bool = False,
        **engine_kwargs: object,
    ) -> None:
        self.on_cpu = current_platform.is_cpu()
        self.choices: VllmChoices = resolve_vllm_choices(
            self.on_cpu, enforce_eager, seeded_sampling, engine_process
        )
        self.tensor_parallel_size = tensor_parallel_size
        # vLLM's workers are processes of their own (its multiprocessing executor; on CPU also for a separate
        # engine core at TP 1: vllm/platforms/cpu.py, check_and_update_config)
        workers_elsewhere = tensor_parallel_size > 1 or self.choices.separate_process
        prepare_process(
            self.choices.separate_process,
            self.on_cpu,
            tensor_parallel_size if workers_elsewhere else 0,
        )
        self.sleep_supported = current_platform.is_sleep_mode_available()
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.tied_embeddings = bool(hf_config.get("tie_word_embeddings"))
        self.cpu_moe = self.on_cpu and is_moe_config(hf_config)  # see vllm_cpu_moe_repack
        self.weight_transfer = self._weight_transfer(workers_elsewhere)
        self.weight_chunk_bytes = int(weight_chunk_bytes)
        self.lora = AdapterSlot() if max_lora_rank else None
        self.stop_token_ids = list(stop_token_ids)
        self._live: dict[str, _Live] = {}  # step-API requests in flight, by caller id, in add order
        log_choices(self.choices, self.on_cpu, enforce_eager, seeded_sampling, engine_process)
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=self.choices.enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleep_supported,
            **self._memory_args(gpu_memory_utilization, cpu_kv_cache_bytes),
            **self._engine_args(engine_kwargs, max_model_len, max_lora_rank, return_routes),
        )
        if self.weight_transfer:
            self.llm.collective_rpc(
                "init_weight_transfer_engine",
                args=(vllm_weight_transfer.init_info(self.weight_transfer),),
            )

    def _weight_transfer(self, workers_elsewhere: bool) -> str | None:
        """The weight-transfer backend where vLLM's workers are processes of their own (None: in this process,
        or no backend); what it and a CPU MoE's repack send a separate engine core is let through."""
        backend = _weight_transfer_backend(self.on_cpu) if workers_elsewhere else None
        why = engine_core_takes_pickles(self.choices.separate_process, backend, self.cpu_moe)
        if why:
            let_engine_core_unpickle(why)
        return backend

    def _route_args(self, return_routes: bool) -> dict[str, bool]:
        """vLLM's arguments for returning routed experts (none without ``return_routes``); refused on CPU."""
        if not return_routes:
            return {}
        if self.on_cpu:
            raise ValueError(
                "return_routes: vLLM collects routed experts in its GPU model runner (V2) only; on CPU use "
                "engine=torch, which returns them"
            )
        return {"enable_return_routed_experts": True, "enable_prefix_caching": True}

    def _memory_args(
        self, gpu_memory_utilization: float, cpu_kv_cache_bytes: int
    ) -> dict[str, float | int]:
        """What bounds the engine's memory: the KV cache's bytes on CPU, a share of the GPU's memory on GPU."""
        if self.on_cpu:
            return {"kv_cache_memory_bytes": int(cpu_kv_cache_bytes)}
        return {"gpu_memory_utilization": gpu_memory_utilization}

    def _engine_args(
        self,
        engine_kwargs: dict[str, object],
        max_model_len: int,
        max_lora_rank: int,
        return_routes: bool = False,
    ) -> dict[str, object]:
        """The caller's other engine arguments, with this engine's defaults, its LoRA serving and its returned
        routes added."""
        args = {**engine_kwargs, **self._route_args(return_routes)}
        if self.on_cpu:
            # No chunked prefill on CPU: a prefill split over two engine steps discards the token sampled after
            # its first part and rewinds that request's seeded generator (``gen.set_offset``), which a CPU
            # torch.Generator does not support: "CPU Generator does not use offset" ends the engine. Long
            # prompts arriving together (the rows of multi-turn episodes) trigger it. Unchunked, a prompt that
            # does not fit in this step's token budget waits for the next step.
            args.setdefault("enable_chunked_prefill", False)
            args.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
        if self.weight_transfer:
            args.setdefault("weight_transfer_config", {"backend": self.weight_transfer})
        if max_lora_rank:
            args.update(enable_lora=True, max_loras=1, max_lora_rank=int(max_lora_rank))
        return args

    def _generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling
    ) -> list[list[Completion]]:
        """Through ``LLM.generate``: with a seed, prompt ``i`` samples from seed ``seed + i * n`` (vLLM gives its
        ``n`` children ``+0 .. +n-1``); unless the engine was started without ``seeded_sampling``, which drops
        every seed. At ``temperature=0`` the logprobs are the plain log-softmax of the logits.

        ``LLM.generate`` steps the engine until no request is left, so it would run the step API's requests to
        the end and drop their outputs: hence refused while any is in flight.
        """
        params = [
            self._sampling_params(
                sampling
                if sampling.seed is None
                else replace(sampling, seed=sampling.seed + i * n),
                n=n,
            )
            for i in range(len(prompt_token_ids))
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        outputs = self.llm.generate(
            prompts, params, use_tqdm=False, lora_request=self._lora_request()
        )
        return [
            [self._completion(c) for c in sorted(out.outputs, key=lambda c: c.index)]
            for out in outputs
        ]

    def _sampling_params(self, sampling: Sampling, n: int = 1) -> SamplingParams:
        """The same stop tokens and logprobs (the sampled token's only) for ``generate`` and the step API; the seed
        only where the engine samples seeded (``seeded_sampling``)."""
        return SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed if self.choices.seeded_sampling else None,
            logprobs=0,
            ignore_eos=sampling.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            detokenize=False,
        )

    def _completion(self, out: CompletionOutput) -> Completion:
        token_ids = list(out.token_ids)
        return Completion(
            token_ids,
            self._logprobs(token_ids, out.logprobs),
            str(out.finish_reason),
            self.version,
            _routes(out.routed_experts),
        )

    @staticmethod
    def _logprobs(token_ids: list[int], per_position: SampleLogprobs | None) -> list[float]:
        # logprobs=0 returns, per position, a dict holding just the sampled token's entry.
        return [float(step[tok].logprob) for tok, step in zip(token_ids, per_position)]

    # Step API: one request at a time, one engine step at a time.
    #
    # A sample-level rollout scheduler keeps the engine full by adding a prompt whenever one finishes,
    # takes each completion as soon as it is done, and before a weight update aborts the stragglers.
    # An aborted request hands back what it generated so far: the scheduler resumes it later as a new
    # request whose prompt is prompt + partial tokens, so no sampled token is thrown away. Outputs are
    # requested in DELTA mode (only the new tokens of each step) and gathered here per request, because
    # vLLM's abort returns nothing to a synchronous caller.

    def _start(self, request_id: str, prompt_token_ids: list[int], sampling: Sampling) -> _Live:
        params = self._sampling_params(sampling)
        params.output_kind = RequestOutputKind.DELTA
        # Rendered as LLM.generate does (raw prompt dicts are deprecated input to the engine).
        (prompt,) = self.llm.renderer.render_cmpl(
            [parse_model_prompt(self.llm.model_config, {"prompt_token_ids": prompt_token_ids})]
        )
        engine_id = self.llm.llm_engine.add_request(
            request_id, prompt, params, lora_request=self._lora_request()
        )
        return _Live(engine_id, self.version)

    def step(self) -> list[tuple[str, Completion]]:
        """Run one engine step; return the requests that finished in it, with all their tokens."""
        if not self._live:
            return []
        finished = []
        for out in self.llm.llm_engine.step():
            live = self._live.get(out.request_id)  # the caller's id (vLLM reports the external one)
            if live is None:
                continue
            delta = out.outputs[0]
            new_tokens = list(delta.token_ids)
            live.token_ids += new_tokens
            live.logprobs += self._logprobs(new_tokens, delta.logprobs)
            if out.finished:
                live.routes = _routes(delta.routed_experts)
                del self._live[out.request_id]
                finished.append((out.request_id, Completion.of(live, str(delta.finish_reason))))
        return finished

    def _stop(self, requests: list[_Live]) -> None:
        self.llm.llm_engine.abort_request([live.engine_id for live in requests], internal=True)

    # weights and memory

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into the running engine: ALL of the checkpoint's tensors (vLLM's
        ``reload_weights`` rebuilds every parameter, so one left out would be lost; a tied checkpoint's
        ``lm_head.weight`` is added from the embedding here); or, on an engine that serves LoRA, the adapters
        alone. Tensors are copied in (the caller may reuse its buffers afterwards). Cached prefixes were
        computed with the old weights, so the prefix cache is dropped."""
        named_tensors = iter(named_tensors)
        first = next(named_tensors, None)  # (also says whether these are a LoRA trainer's adapters)
        if first is None:
            raise ValueError("update_weights() needs the model's tensors, got none")
        named_tensors = itertools.chain([first], named_tensors)
        if ".lora_A." in first[0] or ".lora_B." in first[0]:
            self._load_adapters(named_tensors)
        else:
            self._reload_weights(named_tensors)
        self.llm.reset_prefix_cache()

    def _reload_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The whole model's tensors, in place: vLLM's weight-transfer protocol where its workers are processes
        of their own, else ``reload_weights``; a CPU MoE's experts packed again after."""
        weights = _with_tied_head(named_tensors) if self.tied_embeddings else named_tensors
        gates: dict[int, torch.Tensor] = {}
        if self.cpu_moe:
            weights = capture_expert0_gates(weights, gates)
        if self.weight_transfer == vllm_weight_transfer.SHM_BACKEND:
            vllm_weight_transfer.send_shm(self.llm.collective_rpc, weights, self.weight_chunk_bytes)
        elif self.weight_transfer:
            vllm_weight_transfer.send_cuda_ipc(
                self.llm.collective_rpc,
                weights,
                self.weight_chunk_bytes,
                self.tensor_parallel_size,
            )
        # fallback: the model pickled whole
        elif self.tensor_parallel_size > 1 or self.choices.separate_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
        else:  # the in-process executor calls the worker directly: a lazy iterator is fine
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if gates:
            packed = self.llm.collective_rpc(repack_after_reload, args=(gates,))
            if any(packed) and self.version == 0:
                log.info(
                    "vLLM CPU MoE: packed the experts of %d layer(s) again after the weight reload "
                    "(vLLM leaves them in checkpoint layout)",
                    max(packed),
                )

    def _load_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A LoRA trainer's adapters become the served adapter, in place of the previous version's."""
        if self.lora is None:
            raise ValueError(
                "update_weights() got LoRA adapters, but this engine serves none: start it with "
                "max_lora_rank (the generate role's max_lora_rank option)"
            )
        request = self.lora.write({name: tensor for name, tensor in named_tensors})
        # load_inplace: the adapter's slot takes the new tensors
        self.llm.llm_engine.add_lora(request)

    def _lora_request(self) -> LoRARequest | None:
        """What every request names: the served adapter (None until the first adapters arrive: the base)."""
        return None if self.lora is None else self.lora.request

    def _release_memory(self, level: int) -> None:
        # vLLM has no sleep mode on CPU (its CPU worker ignores the call): there nothing is freed. Refused with
        # requests in flight (by sleep()): vLLM's sleep would abort them without handing back their partials.
        if self.sleep_supported:
            self.llm.sleep(level=level)

    def _restore_memory(self, tags: list[str] | None) -> None:
        if self.sleep_supported:
            self.llm.wake_up(tags=tags)


def _weight_transfer_backend(on_cpu: bool) -> str | None:
    """The weight-transfer backend for worker processes, or None (with a warning) where there is none: the
    CPU one is ours, a vLLM plugin that needs rollhpc installed (see vllm_weight_transfer)."""
    backend = vllm_weight_transfer.backend_for(on_cpu)
    if (
        backend == vllm_weight_transfer.SHM_BACKEND
        and not vllm_weight_transfer.shm_backend_registered()
    ):
        log.warning(
            "vLLM worker processes on CPU (tensor_parallel_size > 1 or engine_process=separate): the '%s' "
            "weight-transfer plugin is not loaded "
            "(rollhpc not pip-installed, or VLLM_PLUGINS leaves it out); every weight update will be "
            "pickled whole to each worker process",
            backend,
        )
        return None
    return backend


def _with_tied_head(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, plus ``lm_head.weight`` = the embedding when only the embedding is given.

    A tied checkpoint has no lm_head tensor, but vLLM's ``reload_weights`` rebuilds every parameter it
    is not handed: without this the output layer silently stops being the embedding (found by
    comparing trainer and generator log-probs after a training step)."""
    embedding = None
    head_seen = False
    for name, tensor in named_tensors:
        if name == "model.embed_tokens.weight":
            embedding = tensor
        head_seen |= name == "lm_head.weight"
        yield name, tensor
    if embedding is not None and not head_seen:
        yield "lm_head.weight", embedding


def _routes(routed_experts: np.ndarray | None) -> np.ndarray | None:
    """vLLM's routed experts of a finished request ([fed tokens, MoE layers, top k]) as ``Completion.routes``."""
    return None if routed_experts is None else np.asarray(routed_experts, dtype=np.int16)
