"""A generation engine in plain torch for small dense models (``engine: torch``), with vLLM's contract.

Why: at the sizes a laptop or a 2-core CI node trains (0.4M-20M parameters) an engine step is mostly
bookkeeping. vLLM's CPU step spends ~10 ms per step in its scheduler, KV block manager and output
processing whatever the model, which at the quickstart size is most of a rollout and at 6M parameters
still a third of it (bench/README.md). This engine keeps one fixed KV cache slot per running request and
runs every running request's next token as one batch: a step is the model's matmuls plus ~100 small torch
ops; requests that start together with the same prompt (a GRPO group) share its prefill. It does none of
what large models need (paged KV, a prefix cache, tensor parallelism, CUDA graphs):
use vLLM for those, which stays the default.

The contract is ``VllmGenerator``'s (``rollhpc.engines.vllm_engine``): token ids in and out, generation
stops at the checkpoint's EOS ids (generation_config.json) and ``stop_token_ids``, each completion carries
the log-probability of every sampled token under the distribution it was sampled from (after temperature
and top-p), ``update_weights`` takes Hugging Face-named tensors and records a version, the step API
(``add_request`` / ``step`` / ``abort``) hands back partials on abort, and with a seed a request samples
from a stream of its own (prompt ``i`` of ``generate`` gets ``seed + i * n + j`` for its ``j``-th sample).
The streams are torch's, not vLLM's: the same seed gives other samples than vLLM does.

Models (``rollhpc.engines.torch_model``, the weights and the forward): Qwen2 and Llama-style dense decoders and
Qwen2-MoE (``model_type`` qwen2, llama or qwen2_moe, default RoPE, no sliding window); anything else is refused
when the engine starts. For a MoE model each completion carries its routes (routing replay r3): the top-k experts
of every token fed to the model in each MoE layer, the prompt's from its prefill and one per decode step.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from rollhpc.engines.completion import Completion, Sampling, StepEngine
from rollhpc.engines.torch_model import DecoderModel

__all__ = ["TorchGenerator"]

log = logging.getLogger(__name__)


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    sampling: Sampling
    version: int
    generator: torch.Generator | None  # its own sampling stream when seeded
    slot: int = -1  # KV cache slot while running, -1 while waiting
    cached: int = 0  # tokens whose keys and values are in the slot
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # MoE models: (MoE layers, top-k) of a position's routes, and the routes of the tokens fed so far, in
    # chunks (int16 [positions, layers, k]: the prompt's, then one per decode step); None: a dense model
    route_shape: tuple[int, int] | None = None
    route_chunks: list[np.ndarray] = field(default_factory=list)

    @property
    def routes(self) -> np.ndarray | None:
        """int16 [fed, MoE layers, top_k]: the experts of every token fed so far (the prompt and every sampled
        token but the last: ``Completion.routes``); None for a dense model."""
        if self.route_shape is None:
            return None
        if not self.route_chunks:
            return np.zeros((0, *self.route_shape), dtype=np.int16)
        return np.concatenate(self.route_chunks)


class TorchGenerator(StepEngine[_Request]):
    """``VllmGenerator``'s interface on ``DecoderModel``: continuous batching over fixed KV cache slots.

    Args:
        model_dir: Hugging Face checkpoint directory (config.json + safetensors).
        seed: the stream of requests without a seed of their own.
        max_model_len: prompt + completion tokens per sequence (the length of a KV cache slot).
        cpu_kv_cache_bytes: KV cache size; it decides how many requests run at once (at most
            ``max_num_seqs``); the others wait for a slot.
        dtype: "float32", "bfloat16", "float16" or "auto" (the checkpoint's).
        stop_token_ids: extra ids that end every completion.

    ``sleep()`` frees nothing (``sleep_supported`` is false): it only marks the engine asleep, as vLLM on CPU.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        seed: int = 0,
        max_model_len: int = 1024,
        cpu_kv_cache_bytes: int = 256 << 20,
        dtype: str = "auto",
        stop_token_ids: Sequence[int] = (),
        max_num_seqs: int = 256,
        tensor_parallel_size: int = 1,
        **_unused: object,
    ) -> None:
        if tensor_parallel_size != 1:
            raise ValueError(
                f"engine=torch runs on one device, not tensor_parallel_size={tensor_parallel_size}"
            )
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        if dtype == "auto":
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.on_cpu = self.device.type == "cpu"
        self.max_model_len = max_model_len
        self.model = DecoderModel(config, getattr(torch, dtype), self.device, max_model_len)
        self.model.load(_checkpoint_tensors(model_dir))
        self._allocate_kv_cache(int(cpu_kv_cache_bytes), max_num_seqs)
        self.stop_token_ids = list(stop_token_ids)
        self.stop_ids = set(_eos_ids(model_dir, config)) | set(self.stop_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.tensor_parallel_size = 1
        self._live: dict[str, _Request] = {}  # waiting and running, by caller id, in add order
        self._running: list[_Request] = []  # by slot: the running requests hold slots 0..len-1
        log.info(
            "torch engine on %s: %s, %d KV cache slots of %d tokens",
            self.device,
            dtype,
            self.slots,
            max_model_len,
        )

    def _allocate_kv_cache(self, nbytes: int, max_num_seqs: int) -> None:
        """As many slots of ``max_model_len`` tokens as ``nbytes`` hold (1 to ``max_num_seqs``); keys and
        values in float32 whatever the weights: attention reads them as they are, with no conversion."""
        m = self.model
        slot_bytes = 2 * m.layers * m.kv_heads * self.max_model_len * m.head_dim * 4
        self.slots = max(1, min(max_num_seqs, nbytes // slot_bytes))
        shape = (m.layers, self.slots, m.kv_heads, self.max_model_len, m.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.float32, device=self.device)

    # batch generation and the step API

    def _generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling
    ) -> list[list[Completion]]:
        """Through the step API: with a seed, prompt ``i``'s ``j``-th sample has stream ``seed + i * n + j``."""
        ids = [[f"generate-{i}-{j}" for j in range(n)] for i in range(len(prompt_token_ids))]
        for i, prompt in enumerate(prompt_token_ids):
            for j in range(n):
                seed = None if sampling.seed is None else sampling.seed + i * n + j
                self._enqueue(ids[i][j], list(prompt), replace(sampling, seed=seed))
        done = dict(self.run_until(min_finished=len(prompt_token_ids) * n))
        return [[done[rid] for rid in row] for row in ids]

    def _start(self, request_id: str, prompt_token_ids: list[int], sampling: Sampling) -> _Request:
        """A waiting request; it runs from the next ``step`` that has a free slot."""
        if not 0 < len(prompt_token_ids) < self.max_model_len:
            raise ValueError(
                f"a prompt of {len(prompt_token_ids)} tokens: it needs 1 to max_model_len - 1 "
                f"= {self.max_model_len - 1} tokens"
            )
        if sampling.max_tokens < 1 or sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise ValueError("need max_tokens >= 1, temperature >= 0 and top_p in (0, 1]")
        seed = sampling.seed
        gen = None if seed is None else torch.Generator(device=self.device).manual_seed(int(seed))
        return _Request(
            request_id,
            prompt_token_ids,
            sampling,
            self.version,
            gen,
            route_shape=self.model.route_shape,
        )

    def step(self) -> list[tuple[str, Completion]]:
        """Start waiting requests that fit in free slots (prefill: each samples its first token), give every
        request that was already running its next token; return the requests that finished."""
        if not self._live:
            return []
        running = list(self._running)
        starting = []
        for r in self._live.values():
            if r.slot < 0 and len(self._running) < self.slots:
                r.slot = len(self._running)
                self._running.append(r)
                starting.append(r)
        with torch.inference_mode():
            if starting:
                self._sample(starting, self._prefill(starting))
            if running:
                self._sample(running, self._decode(running))
        finished = []
        for r in starting + running:
            reason = self._finish_reason(r)
            if reason:
                del self._live[r.rid]
                self._free_slot(r)
                finished.append((r.rid, Completion.of(r, reason)))
        return finished

    def _stop(self, requests: list[_Request]) -> None:
        for r in requests:
            self._free_slot(r)

    # weights

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (all or some of them)."""
        if isinstance(named_tensors, (list, tuple)) and not named_tensors:
            raise ValueError("update_weights() needs the model's tensors, got none")
        self.model.load(named_tensors)

    # internals

    def _prefill(self, reqs: list[_Request]) -> torch.Tensor:
        """Logits after each request's prompt. Requests with the same prompt (a GRPO group's samples) share one
        forward: the first one's keys and values (and its prompt's routes) are copied into the others'."""
        row: dict[tuple[int, ...], int] = {}  # prompt -> its row among the distinct prompts
        index = [row.setdefault(tuple(r.prompt), len(row)) for r in reqs]
        if len(row) == len(reqs):
            return self._prefill_unique(reqs)
        # row -> the first request with that prompt (rows come in order)
        leaders: dict[int, _Request] = {}
        for r, n in zip(reqs, index):
            leaders.setdefault(n, r)
        logits = self._prefill_unique(list(leaders.values()))
        for r, n in zip(reqs, index):
            leader = leaders[n]
            if r is not leader:
                k = len(r.prompt)
                self.k_cache[:, r.slot, :, :k] = self.k_cache[:, leader.slot, :, :k]
                self.v_cache[:, r.slot, :, :k] = self.v_cache[:, leader.slot, :, :k]
                r.cached = k
                r.route_chunks = list(leader.route_chunks)
        return logits[torch.tensor(index, device=logits.device)]

    def _prefill_unique(self, reqs: list[_Request]) -> torch.Tensor:
        """Logits after each request's prompt, prefilled in chunks of at most ~8k padded tokens; a MoE model's
        routes of each prompt's positions go to its request."""
        out = []
        i = 0
        while i < len(reqs):
            width = len(reqs[i].prompt)
            j = i + 1
            while j < len(reqs) and (j - i + 1) * max(width, len(reqs[j].prompt)) <= 8192:
                width = max(width, len(reqs[j].prompt))
                j += 1
            chunk = reqs[i:j]
            tokens = torch.zeros((len(chunk), width), dtype=torch.long, device=self.device)
            for row, r in enumerate(chunk):
                tokens[row, : len(r.prompt)] = torch.tensor(r.prompt)
                r.cached = len(r.prompt)
            lengths = torch.tensor([len(r.prompt) for r in chunk], device=self.device)
            slots = torch.tensor([r.slot for r in chunk], device=self.device)
            logits, routes = self.model.forward(
                tokens,
                torch.arange(width, device=self.device),
                self.k_cache,
                self.v_cache,
                slots,
                lengths,
            )
            out.append(logits)
            if routes is not None:
                rows = routes.to(device="cpu", dtype=torch.int16).numpy()
                for row, r in enumerate(chunk):
                    r.route_chunks.append(rows[row, : len(r.prompt)])
            i = j
        return torch.cat(out)

    def _decode(self, running: list[_Request]) -> torch.Tensor:
        """Logits after each running request's last token, which goes into its slot's cache (and, for a MoE
        model, whose routes go to its request)."""
        tokens = torch.tensor([[r.token_ids[-1]] for r in running], device=self.device)
        positions = torch.tensor([r.cached for r in running], device=self.device)
        logits, routes = self.model.forward(
            tokens, positions, self.k_cache, self.v_cache, None, None
        )
        for r in running:
            r.cached += 1
        if routes is not None:
            rows = routes.to(device="cpu", dtype=torch.int16).numpy()  # [m, 1, layers, k]
            for r, row in zip(running, rows):
                r.route_chunks.append(row)
        return logits

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """One token per request from its row of ``logits`` [m, V] (float32), with its log-probability under
        the distribution it was drawn from: temperature, then top-p (renormalized); greedy at temperature 0."""
        temps = torch.tensor([r.sampling.temperature for r in reqs], device=logits.device)
        greedy = temps == 0
        z = logits / torch.where(greedy, 1.0, temps)[:, None]
        top_p = torch.tensor([r.sampling.top_p for r in reqs], device=logits.device)
        if bool((top_p < 1).any()):
            sorted_z, order = z.sort(dim=-1, descending=True)
            # mass of the tokens ranked above
            before = sorted_z.softmax(-1).cumsum(-1) - sorted_z.softmax(-1)
            cut = (before >= top_p[:, None]) & ~greedy[:, None]
            z = z.masked_fill(torch.zeros_like(cut).scatter(-1, order, cut), -math.inf)
        logp = z.log_softmax(-1)
        noise = torch.empty_like(logp)
        shared = [i for i, r in enumerate(reqs) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(
                (len(shared), logp.shape[1]), device=logits.device
            ).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        # exp(logp) / Exp(1) noise: its argmax is a sample of softmax(z) (the exponential race)
        tokens = torch.where(greedy, logp.argmax(-1), (logp.exp() / noise).argmax(-1))
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        for r, tok, lp in zip(reqs, tokens.tolist(), chosen.tolist()):
            r.token_ids.append(tok)
            r.logprobs.append(lp)

    def _finish_reason(self, r: _Request) -> str | None:
        if not r.sampling.ignore_eos and r.token_ids[-1] in self.stop_ids:
            return "stop"
        if (
            len(r.token_ids) >= r.sampling.max_tokens
            or len(r.prompt) + len(r.token_ids) >= self.max_model_len
        ):
            return "length"
        return None

    def _free_slot(self, r: _Request) -> None:
        """Free a finished or aborted request's slot; the last running one moves into it (keys and values too),
        so the running requests stay packed in slots 0..n-1 and a decode step reads the cache as views, not a
        gather."""
        if r.slot < 0:
            return
        last = self._running.pop()
        if last is not r:
            self.k_cache[:, r.slot, :, : last.cached] = self.k_cache[:, last.slot, :, : last.cached]
            self.v_cache[:, r.slot, :, : last.cached] = self.v_cache[:, last.slot, :, : last.cached]
            last.slot = r.slot
            self._running[r.slot] = last
        r.slot = -1


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files, by Hugging Face name."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors")
    return ((name, t) for f in files for name, t in load_file(str(f)).items())


def _eos_ids(model_dir: Path, config: dict) -> list[int]:
    """The checkpoint's EOS ids: generation_config.json's, else config.json's."""
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
