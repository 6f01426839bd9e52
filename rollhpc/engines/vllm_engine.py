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
frozen before the engine is built (``_freeze_imported_heap``), and on CPU the sampler's token-rank count
runs eagerly instead of being compiled at the first step (``_eager_token_ranks_on_cpu``).

LoRA (``max_lora_rank`` > 0): the engine serves its base weights plus a LoRA trainer's adapters through vLLM's
own LoRA support (``enable_lora``); ``update_weights`` then takes the adapters alone (``MODULE.lora_A.weight``,
``MODULE.lora_B.weight`` with alpha/r in B: ``rollhpc.models.lora.adapter_sync_tensors``), writes them as a PEFT
directory in this process's scratch space and has vLLM load it in place of the previous version.

GPU speed (``rollhpc.engines.vllm_choices``, each "auto" by platform, logged at start): CUDA graphs
and torch.compile (``enforce_eager`` false), requests without per-request seeds (``seeded_sampling`` false), and
vLLM's engine core in a process of its own (``engine_process``: "separate"), so that this process's Python (the
serving loop, replies to the controller) and the engine's scheduling and sampling do not take turns on one GIL.
With a separate engine core every weight update takes vLLM's weight-transfer protocol, as at TP > 1 (the worker
is in another process: a lazy iterator of live tensors cannot reach it), and messages that vLLM's msgpack channel
carries only pickled (CUDA-IPC handles) are allowed for it (``_engine_core_takes_pickles``). The CPU keeps eager,
seeded, one process.

Left out: async engines (one thread drives the step API of the synchronous engine), multimodal inputs.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
from pathlib import Path
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollhpc.engines.completion import Completion, StepEngine
from rollhpc.engines.vllm_choices import AutoBool, EngineProcess, VllmChoices, resolve_vllm_choices
from rollhpc.engines.vllm_cpu_moe_repack import (
    capture_expert0_gates,
    is_moe_config,
    repack_after_reload,
)

if TYPE_CHECKING:
    import torch

__all__ = ["VllmGenerator"]

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """A step-API request between ``add_request`` and its finish or abort."""

    engine_id: str  # vLLM's internal id (the caller's id plus a random suffix)
    version: int  # weights version live when it was added
    token_ids: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[float] = field(default_factory=list)


class VllmGenerator(StepEngine):
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
        **engine_kwargs: Any,
    ) -> None:
        # Must be set before vllm is imported: vLLM logs through this process's logging config instead of
        # installing its own handlers.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.choices: VllmChoices = resolve_vllm_choices(
            self.on_cpu, enforce_eager, seeded_sampling, engine_process
        )
        _set_engine_process(self.choices.separate_process)
        from vllm import LLM

        _freeze_imported_heap()
        _quiet_chat_template_warmup()
        # vLLM's workers are processes of their own (its multiprocessing executor; on CPU also for a separate
        # engine core at TP 1: vllm/platforms/cpu.py, check_and_update_config)
        workers_elsewhere = tensor_parallel_size > 1 or self.choices.separate_process
        if self.on_cpu:
            _eager_token_ranks_on_cpu()
            if workers_elsewhere:
                _bind_cpu_workers(tensor_parallel_size)
            # No chunked prefill on CPU: a prefill split over two engine steps discards the token sampled after
            # its first part and rewinds that request's seeded generator (``gen.set_offset``), which a CPU
            # torch.Generator does not support: "CPU Generator does not use offset" ends the engine. Long
            # prompts arriving together (the rows of multi-turn episodes) trigger it. Unchunked, a prompt that
            # does not fit in this step's token budget waits for the next step.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
        self.sleep_supported = current_platform.is_sleep_mode_available()
        memory = (
            {"kv_cache_memory_bytes": int(cpu_kv_cache_bytes)}
            if self.on_cpu
            else {"gpu_memory_utilization": gpu_memory_utilization}
        )
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.tied_embeddings = bool(hf_config.get("tie_word_embeddings"))
        self.cpu_moe = self.on_cpu and is_moe_config(hf_config)  # see vllm_cpu_moe_repack
        self.weight_transfer = _weight_transfer_backend(self.on_cpu) if workers_elsewhere else None
        why = _engine_core_takes_pickles(
            self.choices.separate_process, self.weight_transfer, self.cpu_moe
        )
        if why:
            _let_engine_core_unpickle(why)
        if self.weight_transfer:
            engine_kwargs.setdefault("weight_transfer_config", {"backend": self.weight_transfer})
        self.weight_chunk_bytes = int(weight_chunk_bytes)
        if max_lora_rank:
            engine_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=int(max_lora_rank))
        self.lora = _AdapterSlot() if max_lora_rank else None
        _log_choices(self.choices, self.on_cpu, enforce_eager, seeded_sampling, engine_process)
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
            **memory,
            **engine_kwargs,
        )
        self.tensor_parallel_size = tensor_parallel_size
        if self.weight_transfer:
            from rollhpc.engines import vllm_weight_transfer

            self.llm.collective_rpc(
                "init_weight_transfer_engine",
                args=(vllm_weight_transfer.init_info(self.weight_transfer),),
            )
        self.stop_token_ids = list(stop_token_ids)
        self.version = 0
        self.asleep = False  # no generation until the KV cache is back
        self.weights_asleep = False  # no weight update until the weights are back
        self._live: dict[str, _Live] = {}  # step-API requests in flight, by caller id, in add order

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
        """``n`` completions per prompt, in prompt order.

        With ``seed`` set, prompt ``i`` samples from seed ``seed + i * n`` (vLLM gives its ``n``
        children ``+0 .. +n-1``), so every completion has its own stream and a call is reproducible;
        unless the engine was started without ``seeded_sampling``, which drops every seed.
        ``temperature=0`` is greedy; its logprobs are then the plain log-softmax of the logits.

        Refused while step-API requests are in flight: ``LLM.generate`` steps the engine until no
        request is left, so it would run theirs to the end and drop their outputs.
        """
        self._check_idle("generate()")
        params = [
            self._sampling_params(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                seed=None if seed is None else seed + i * n,
                ignore_eos=ignore_eos,
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

    def _sampling_params(
        self,
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int | None,
        ignore_eos: bool,
    ) -> Any:
        """The same stop tokens and logprobs (the sampled token's only) for ``generate`` and the step API; the seed
        only where the engine samples seeded (``seeded_sampling``)."""
        from vllm import SamplingParams

        if not self.choices.seeded_sampling:
            seed = None
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=0,
            ignore_eos=ignore_eos,
            stop_token_ids=self.stop_token_ids,
            detokenize=False,
        )

    def _completion(self, out: Any) -> Completion:
        token_ids = list(out.token_ids)
        return Completion(
            token_ids, self._logprobs(token_ids, out.logprobs), str(out.finish_reason), self.version
        )

    @staticmethod
    def _logprobs(token_ids: list[int], per_position: Any) -> list[float]:
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
        """Queue one completion of ``prompt_token_ids``; it starts at the next ``step``.

        The weights version live now is recorded with the request and reported by its completion:
        the completion belongs to the weights that sampled it, whenever the caller collects it.
        """
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        self._check_awake()
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already in flight")
        params = self._sampling_params(
            n=1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        params.output_kind = RequestOutputKind.DELTA
        # Rendered as LLM.generate does (raw prompt dicts are deprecated input to the engine).
        (prompt,) = self.llm.renderer.render_cmpl(
            [
                parse_model_prompt(
                    self.llm.model_config, {"prompt_token_ids": list(prompt_token_ids)}
                )
            ]
        )
        engine_id = self.llm.llm_engine.add_request(
            request_id, prompt, params, lora_request=self._lora_request()
        )
        self._live[request_id] = _Live(engine_id, self.version)

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
                del self._live[out.request_id]
                finished.append(
                    (
                        out.request_id,
                        Completion(
                            live.token_ids, live.logprobs, str(delta.finish_reason), live.version
                        ),
                    )
                )
        return finished

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
            self.llm.llm_engine.abort_request(
                [live.engine_id for _, live in aborted], internal=True
            )
        return [
            (rid, Completion(live.token_ids, live.logprobs, "abort", live.version))
            for rid, live in aborted
        ]

    def num_unfinished(self) -> int:
        return len(self._live)

    def unfinished_ids(self) -> list[str]:
        return list(self._live)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load HF-named tensors into the running engine: ALL of the checkpoint's tensors (vLLM's
        ``reload_weights`` rebuilds every parameter, so one left out would be lost; a tied checkpoint's
        ``lm_head.weight`` is added from the embedding here); or, on an engine that serves LoRA, the adapters alone.

        Tensors are copied in (the caller may reuse its buffers afterwards). Cached prefixes were
        computed with the old weights, so the prefix cache is dropped. Refused while step-API
        requests are in flight: their tokens would mix two versions under one recorded version
        (abort them first; the partials resume under the new weights).
        """
        if self.weights_asleep:
            raise RuntimeError(
                "update_weights() while the engine's weights are asleep: wake_up(['weights']) first"
            )
        self._check_idle("update_weights()", generating=False)
        named_tensors = iter(named_tensors)
        first = next(named_tensors, None)  # (also says whether these are a LoRA trainer's adapters)
        if first is None:
            raise ValueError("update_weights() needs the model's tensors, got none")
        named_tensors = itertools.chain([first], named_tensors)
        if ".lora_A." in first[0] or ".lora_B." in first[0]:
            self._load_adapters(named_tensors, version)
            return
        weights = _with_tied_head(named_tensors) if self.tied_embeddings else named_tensors
        gates: dict[int, torch.Tensor] = {}
        if self.cpu_moe:
            weights = capture_expert0_gates(weights, gates)
        if self.weight_transfer:  # worker processes (TP > 1): vLLM's weight-transfer protocol
            from rollhpc.engines import vllm_weight_transfer

            if self.weight_transfer == vllm_weight_transfer.SHM_BACKEND:
                vllm_weight_transfer.send_shm(
                    self.llm.collective_rpc, weights, self.weight_chunk_bytes
                )
            else:
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
        self.llm.reset_prefix_cache()
        self.version = version

    def _load_adapters(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """A LoRA trainer's adapters become the served adapter, in place of the previous version's."""
        if self.lora is None:
            raise ValueError(
                "update_weights() got LoRA adapters, but this engine serves none: start it with "
                "max_lora_rank (the generate role's max_lora_rank option)"
            )
        request = self.lora.write({name: tensor for name, tensor in named_tensors})
        # load_inplace: the adapter's slot takes the new tensors
        self.llm.llm_engine.add_lora(request)
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the previous adapter
        self.version = version

    def _lora_request(self) -> Any:
        """What every request names: the served adapter (None until the first adapters arrive: the base)."""
        return None if self.lora is None else self.lora.request

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (level 1: weights to host, KV cache dropped).

        vLLM has no sleep mode on CPU (its CPU worker ignores the call), so there this only marks the
        engine asleep and nothing is freed. After ``sleep(2)`` (weights discarded) call
        ``update_weights`` right after ``wake_up``. Refused while step-API requests are in flight
        (vLLM's sleep would abort them without handing back their partials).
        """
        self._check_idle("sleep()", generating=False)
        if self.sleep_supported:
            self.llm.sleep(level=level)
        self.asleep = True
        self.weights_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake all of it, or only ``tags`` ("weights", "kv_cache"): a weight sync needs the weights back,
        not yet the KV cache (which then still leaves its memory to the trainer)."""
        if self.sleep_supported:
            self.llm.wake_up(tags=tags)
        if tags is None or "weights" in tags:
            self.weights_asleep = False
        if tags is None or "kv_cache" in tags:
            self.asleep = False


class _AdapterSlot:
    """The one LoRA adapter an engine serves: a PEFT directory in this process's scratch space (shared memory
    where the machine has it: vLLM's loader reads a path, also from its TP worker processes), rewritten for
    each version and loaded in place under one adapter id."""

    ADAPTER_ID = 1

    def __init__(self) -> None:
        import shutil
        import tempfile
        import weakref

        shm = Path("/dev/shm")
        self.dir = Path(tempfile.mkdtemp(prefix="rollhpc-lora-", dir=shm if shm.is_dir() else None))
        # gone with the engine, or at exit
        weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.request: Any = None  # what requests name, once an adapter is loaded

    def write(self, tensors: dict[str, torch.Tensor]) -> Any:
        """Write ``tensors`` (HF module names, alpha/r already in B) as the adapter; returns the request that
        loads it in place."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        a = [t for name, t in tensors.items() if ".lora_A." in name]
        if not a or len(a) * 2 != len(tensors):
            raise ValueError(
                f"LoRA adapters come as lora_A/lora_B pairs, got {sorted(tensors)[:4]}..."
            )
        rank = int(a[0].shape[0])
        modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
        save_file(
            {
                f"base_model.model.{k}": v.detach().to("cpu").contiguous()
                for k, v in tensors.items()
            },
            str(self.dir / "adapter_model.safetensors"),
        )
        # alpha = r: the scaling alpha/r is already in B
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": rank,
            "lora_dropout": 0.0,
            "target_modules": modules,
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
        }
        (self.dir / "adapter_config.json").write_text(json.dumps(config))
        self.request = LoRARequest("policy", self.ADAPTER_ID, str(self.dir))
        return LoRARequest("policy", self.ADAPTER_ID, str(self.dir), load_inplace=True)


def _set_engine_process(separate: bool) -> None:
    """Put vLLM's engine core in this process or in its own (``VLLM_ENABLE_V1_MULTIPROCESSING``, read by
    ``LLMEngine.from_engine_args``), and check that vLLM sees it: an in-process engine core caches vLLM's whole
    environment when it starts (``vllm.envs.enable_envs_cache`` in ``EngineCore.__init__``), after which a later
    engine of this process could no longer change it and would silently run in the first one's mode."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate else "0"
    import vllm.envs as envs

    if bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) != separate:
        raise RuntimeError(
            f"engine_process={'separate' if separate else 'same'}: an earlier vLLM engine of this "
            "process ran with the other mode and vLLM has cached its environment since; one mode per "
            "process (set engine_process alike for every engine of a process)"
        )


def _engine_core_takes_pickles(
    separate_process: bool, weight_transfer: str | None, cpu_moe: bool
) -> str | None:
    """Why this engine sends its engine core what vLLM's message encoder takes only through pickle, or None.

    A separate engine core is reached through msgpack (vllm/v1/serial_utils.py), which refuses anything but plain
    data and tensors unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 (MsgpackEncoder.enc_hook; the engine core's decoder
    checks it as well). Two of this engine's messages are not plain: the CUDA-IPC weight transfer's handles
    (torch.multiprocessing's rebuild arguments hold a storage class, a dtype and a device), and on CPU a MoE
    model's expert repack after each weight update (a function: vllm_cpu_moe_repack). In one process, or with
    the CPU's shared-memory transfer (names, offsets, a segment name), nothing needs pickle."""
    if not separate_process:
        return None
    if weight_transfer == "ipc":
        return "the CUDA-IPC weight transfer's handles (rebuild arguments with a dtype, a device, a class)"
    if cpu_moe:
        return "a MoE model's expert repack after each weight update on CPU (a function)"
    return None


def _let_engine_core_unpickle(why: str) -> None:
    """Let this process's own engine core take pickled messages (VLLM_ALLOW_INSECURE_SERIALIZATION=1, inherited by
    the engine core's process), unless the user said no: then refuse at start rather than at the first weight
    sync. Pickle is vLLM's concern for sockets that others may reach; here the peer is this process's child,
    on a local IPC socket of this user."""
    value = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    if value is None:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        log.info(
            "vLLM engine core in its own process: VLLM_ALLOW_INSECURE_SERIALIZATION=1 for %s", why
        )
    elif value.strip() in ("", "0"):
        raise ValueError(
            f"engine_process=separate sends the engine core {why}, which vLLM pickles only with "
            f"VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set to {value!r} here): unset it, or use "
            "engine_process=same"
        )


def _log_choices(choices: VllmChoices, on_cpu: bool, *given: bool | str) -> None:
    """One line per engine start with what each speed option came to, and whether it was asked for or "auto":
    the first thing to read when a GPU run is slower than expected."""
    values = (
        choices.enforce_eager,
        choices.seeded_sampling,
        "separate" if choices.separate_process else "same",
    )
    names = ("enforce_eager", "seeded_sampling", "engine_process")
    log.info(
        "vLLM engine on %s: %s",
        "CPU" if on_cpu else "GPU",
        ", ".join(
            f"{n}={v}" + (" (auto)" if g == "auto" else "") for n, v, g in zip(names, values, given)
        ),
    )


def _bind_cpu_workers(tp: int) -> None:
    """Give each of vLLM's CPU worker processes its share of this process's cores, where vLLM cannot itself.

    vLLM's CPU default (``VLLM_CPU_OMP_THREADS_BIND=auto``) binds each TP worker to a NUMA node of its own and
    refuses to start with fewer NUMA nodes than workers, which is the usual case below a large CPU server. Then
    the cores this process may use (its Slurm / MPI binding) are split evenly among the workers, in order. A
    binding set by the user, or enough NUMA nodes for ``auto``, is left alone; with fewer cores than workers
    nothing is bound ("nobind")."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    numa_nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    if numa_nodes >= tp:
        return
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
        "|".join(",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(tp))
        if share
        else "nobind"
    )


def _weight_transfer_backend(on_cpu: bool) -> str | None:
    """The weight-transfer backend for worker processes, or None (with a warning) where there is none: the
    CPU one is ours, a vLLM plugin that needs rollhpc installed (see vllm_weight_transfer)."""
    from rollhpc.engines import vllm_weight_transfer

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


def _freeze_imported_heap() -> None:
    """Collect once, then freeze what is left (the modules torch and vLLM just imported, millions of objects).

    vLLM's engine start walks the whole heap five times (a full collection before and after its model
    loader processes the weights, then ``vllm.utils.gc_utils.freeze_gc_heap``'s three passes, after which it
    freezes the heap itself): ~0.2 s each on CPU. Frozen first, the imported heap is left out of those walks
    (about 1 s less per start). Collecting before freezing keeps the end state vLLM's own freeze gives:
    garbage is freed, not frozen.
    """
    gc.collect()
    gc.freeze()


class _DropChatTemplateWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"


def _quiet_chat_template_warmup() -> None:
    """Drop vLLM's "Chat template warmup failed" warning and its traceback from every engine start's log.

    ``LLM`` renders a chat message at start-up to warm its template, which needs the tokenizer; this engine
    starts vLLM without one (``skip_tokenizer_init``: prompts arrive as token ids, chat templates are applied by
    rollhpc's own tokenizer), so the warm-up always fails, and its traceback read as an error in every
    generate rank's log. Only that record is dropped; vLLM's other warnings stay."""
    logger = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _DropChatTemplateWarmup) for f in logger.filters):
        logger.addFilter(_DropChatTemplateWarmup())


def _eager_token_ranks_on_cpu() -> None:
    """Use the plain function for vLLM's ``batched_count_greater_than`` (the rank of each sampled token).

    vLLM wraps it in ``torch.compile`` (inductor) to spare GPU memory at large batches; on CPU that is a
    C++ build at the engine's first step: 2 s with a warm inductor cache and 13 s with a cold one (a new
    node), paid at every start before the first rollout, for an op that takes microseconds at CPU batch
    sizes (the eager form's temporary is a [requests, vocab] boolean). It returns the same integer counts.
    No other compiled op runs in a dense model's CPU step (measured: one compilation per engine). The
    sampler module's name is rebound, so every engine of this process uses it; left alone if vLLM's sampler
    no longer has it.
    """
    from vllm.v1.sample import sampler

    compiled = getattr(sampler, "batched_count_greater_than", None)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is not None:
        sampler.batched_count_greater_than = eager


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
