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

Models: Qwen2 and Llama-style dense decoders (``model_type`` qwen2 or llama, default RoPE, no sliding
window); anything else is refused when the engine starts.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from rollhpc.engines.completion import Completion, StepEngine

__all__ = ["TorchGenerator"]

log = logging.getLogger(__name__)

SUPPORTED = ("qwen2", "llama")


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    version: int
    generator: torch.Generator | None  # its own sampling stream when seeded
    slot: int = -1  # KV cache slot while running, -1 while waiting
    cached: int = 0  # tokens whose keys and values are in the slot
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class _Model:
    """The decoder's weights (q/k/v and gate/up fused for fewer, larger matmuls) and its forward."""

    def __init__(self, config: dict, dtype: torch.dtype, device: torch.device, max_len: int):
        model_type = config.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(
                f"engine=torch runs {', '.join(SUPPORTED)} decoders, not model_type={model_type!r}: "
                "use engine=vllm"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(
                f"engine=torch supports default RoPE only, the checkpoint has {rope}: use engine=vllm"
            )
        if config.get("use_sliding_window"):
            raise ValueError("engine=torch has no sliding-window attention: use engine=vllm")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"engine=torch supports silu MLPs, not {config.get('hidden_act')!r}: use engine=vllm"
            )
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.hidden = int(config["hidden_size"])
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
        self.dtype, self.device = dtype, device
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        inv = 1.0 / theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        )
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)  # [max_len, head_dim]
        self.sin = angles.sin().to(device=device, dtype=dtype)
        self.raw: dict[str, torch.Tensor] = {}  # Hugging Face name -> tensor, as loaded
        # LoRA (a trainer's rollhpc.models.lora, synced adapters only): HF module name -> (A [r, in], B [out, r] with
        # alpha/r in it); the served weights are raw + B A, merged when they arrive, raw left as the base
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.w: dict[str, Any] = {}

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        n = 0
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            # MODULE.lora_A.weight / MODULE.lora_B.weight
            if ".lora_A." in name or ".lora_B." in name:
                module, _, rest = name.partition(".lora_")
                pending.setdefault(module, {})[rest[0]] = tensor.detach().to(
                    device=self.device, dtype=torch.float32
                )
                n += 1
            elif name.startswith("model.") or name == "lm_head.weight":
                self.raw[name] = tensor.detach().to(device=self.device, dtype=self.dtype).clone()
                n += 1
        for module, ab in pending.items():
            if set(ab) != {"A", "B"} or f"{module}.weight" not in self.raw:
                raise ValueError(
                    f"engine=torch: adapter {module} needs lora_A and lora_B of a module the model has "
                    f"(got {sorted(ab)})"
                )
            self.adapters[module] = (ab["A"], ab["B"])
        self._fuse()
        return n

    def _fuse(self) -> None:
        r = self.raw

        def get(name: str) -> torch.Tensor:
            if name not in r:
                raise ValueError(f"engine=torch: the checkpoint has no {name}")
            adapter = (
                self.adapters.get(name[: -len(".weight")]) if name.endswith(".weight") else None
            )
            if adapter is None:
                return r[name]
            a, b = adapter
            return (r[name].float() + b @ a).to(self.dtype)

        layers = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            qkv = [f"{p}self_attn.{x}_proj" for x in "qkv"]
            layers.append(
                {
                    "ln1": get(f"{p}input_layernorm.weight"),
                    "ln2": get(f"{p}post_attention_layernorm.weight"),
                    "qkv": torch.cat([get(f"{x}.weight") for x in qkv]),
                    "qkv_b": torch.cat([get(f"{x}.bias") for x in qkv]) if self.bias else None,
                    "o": get(f"{p}self_attn.o_proj.weight"),
                    "gate_up": torch.cat(
                        [get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")]
                    ),
                    "down": get(f"{p}mlp.down_proj.weight"),
                }
            )
        embed = get("model.embed_tokens.weight")
        self.w = {
            "embed": embed,
            "norm": get("model.norm.weight"),
            "layers": layers,
            "head": r.get("lm_head.weight", embed) if self.tied else get("lm_head.weight"),
        }

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor | None,
        lengths: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logits [m, V] (float32) of the last position of each row.

        Prefill (``lengths`` given): ``tokens`` [m, P] right-padded prompts, ``positions`` [P]; keys and
        values of positions 0..P-1 go to each row's slot (padding writes positions the row's later tokens
        overwrite before they are attended to). Decode (``lengths`` None): ``tokens`` [m, 1] at per-row
        ``positions`` [m]; each row attends to its slot's positions 0..position.
        """
        m, t = tokens.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        prefill = lengths is not None
        cos, sin = (self.cos[positions], self.sin[positions])
        cos, sin = (
            (cos[None, :, None], sin[None, :, None])
            if prefill
            else (cos[:, None, None], sin[:, None, None])
        )
        if not prefill:
            span = int(positions.max()) + 1
            visible = (torch.arange(span, device=tokens.device)[None, :] <= positions[:, None])[
                :, None, None
            ]
        x = F.embedding(tokens, self.w["embed"])  # [m, t, H]
        for li, lw in enumerate(self.w["layers"]):
            h = self._norm(x, lw["ln1"])
            qkv = F.linear(h, lw["qkv"], lw["qkv_b"])
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(m, t, nh, hd), cos, sin)
            k = self._rope(k.view(m, t, nkv, hd), cos, sin)
            v = v.view(m, t, nkv, hd)
            if prefill:
                k_cache[li, slots, :, :t] = k.transpose(1, 2).to(k_cache.dtype)
                v_cache[li, slots, :, :t] = v.transpose(1, 2).to(v_cache.dtype)
                # [m, nh, t, hd]
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    is_causal=True,
                    enable_gqa=nkv != nh,
                )
                out = out.transpose(1, 2).reshape(m, t, nh * hd)
            else:  # running requests hold slots 0..m-1 in order (TorchGenerator keeps them packed)
                rows = torch.arange(m, device=tokens.device)
                k_cache[li, rows, :, positions] = k[:, 0].to(k_cache.dtype)
                v_cache[li, rows, :, positions] = v[:, 0].to(v_cache.dtype)
                # views [m, nkv, span, hd]
                keys, values = (
                    k_cache[li, :m, :, :span],
                    v_cache[li, :m, :, :span],
                )
                # the heads sharing a key/value head act as that head's queries: no copy of the cache per head.
                # Plain matmuls: torch's CPU SDPA with a mask takes ~2x longer at these shapes
                scores = torch.matmul(q.view(m, nkv, nh // nkv, hd).float(), keys.transpose(-1, -2))
                probs = (scores * hd**-0.5).masked_fill_(~visible, -math.inf).softmax(-1)
                out = torch.matmul(probs, values).to(x.dtype).reshape(m, 1, nh * hd)
            x = x + F.linear(out, lw["o"])
            gate, up = F.linear(self._norm(x, lw["ln2"]), lw["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw["down"])
        last = x[torch.arange(m, device=x.device), lengths - 1] if prefill else x[:, 0]
        return F.linear(self._norm(last, self.w["norm"]), self.w["head"]).float()


class TorchGenerator(StepEngine):
    """``VllmGenerator``'s interface on ``_Model``: continuous batching over fixed KV cache slots.

    Args:
        model_dir: Hugging Face checkpoint directory (config.json + safetensors).
        seed: the stream of requests without a seed of their own.
        max_model_len: prompt + completion tokens per sequence (the length of a KV cache slot).
        cpu_kv_cache_bytes: KV cache size; it decides how many requests run at once (at most
            ``max_num_seqs``); the others wait for a slot.
        dtype: "float32", "bfloat16", "float16" or "auto" (the checkpoint's).
        stop_token_ids: extra ids that end every completion.
    """

    sleep_supported = (
        False  # nothing is freed by sleep(): it only marks the engine asleep, as vLLM on CPU
    )

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
        **_unused: Any,
    ) -> None:
        from safetensors.torch import load_file

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
        self.model = _Model(config, getattr(torch, dtype), self.device, max_model_len)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir} has no *.safetensors")
        self.model.load((name, t) for f in files for name, t in load_file(str(f)).items())
        m = self.model
        # keys and values in float32 whatever the weights: attention reads them as they are, with no conversion
        slot_bytes = 2 * m.layers * m.kv_heads * max_model_len * m.head_dim * 4
        self.slots = max(1, min(max_num_seqs, int(cpu_kv_cache_bytes) // slot_bytes))
        shape = (m.layers, self.slots, m.kv_heads, max_model_len, m.head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.float32, device=self.device)
        gen = (
            json.loads(p.read_text())
            if (p := model_dir / "generation_config.json").is_file()
            else {}
        )
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.stop_token_ids = list(stop_token_ids)
        self.stop_ids = set(eos) | set(self.stop_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self.asleep = False
        self.weights_asleep = False
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

    # batch generation

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
        """``n`` completions per prompt, in prompt order (``seed``: prompt ``i``'s ``j``-th sample has
        stream ``seed + i * n + j``). Refused while step-API requests are in flight."""
        self._check_idle("generate()")
        ids = [[f"generate-{i}-{j}" for j in range(n)] for i in range(len(prompt_token_ids))]
        for i, prompt in enumerate(prompt_token_ids):
            for j in range(n):
                self.add_request(
                    ids[i][j],
                    prompt,
                    temperature=temperature,
                    top_p=top_p,
                    max_tokens=max_tokens,
                    seed=None if seed is None else seed + i * n + j,
                    ignore_eos=ignore_eos,
                )
        done = dict(self.run_until(min_finished=len(prompt_token_ids) * n))
        return [[done[rid] for rid in row] for row in ids]

    # step API

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
        """Queue one completion; it starts at the next ``step`` that has a free slot."""
        self._check_awake()
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already in flight")
        if not 0 < len(prompt_token_ids) < self.max_model_len:
            raise ValueError(
                f"a prompt of {len(prompt_token_ids)} tokens: it needs 1 to max_model_len - 1 "
                f"= {self.max_model_len - 1} tokens"
            )
        if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("need max_tokens >= 1, temperature >= 0 and top_p in (0, 1]")
        gen = None if seed is None else torch.Generator(device=self.device).manual_seed(int(seed))
        self._live[request_id] = _Request(
            request_id,
            list(prompt_token_ids),
            max_tokens,
            float(temperature),
            float(top_p),
            ignore_eos,
            self.version,
            gen,
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
                tokens = torch.tensor([[r.token_ids[-1]] for r in running], device=self.device)
                positions = torch.tensor([r.cached for r in running], device=self.device)
                logits = self.model.forward(
                    tokens, positions, self.k_cache, self.v_cache, None, None
                )
                for r in running:
                    r.cached += 1
                self._sample(running, logits)
        finished = []
        for r in starting + running:
            reason = self._finish_reason(r)
            if reason:
                self._release(r)
                finished.append((r.rid, Completion(r.token_ids, r.logprobs, reason, r.version)))
        return finished

    def abort(self, request_ids: Iterable[str]) -> list[tuple[str, Completion]]:
        """Stop the named requests in flight; return each one's partial (``finish_reason="abort"``)."""
        if isinstance(request_ids, str):
            raise TypeError("abort() takes a collection of ids, not one id string")
        out = []
        for rid in dict.fromkeys(request_ids):
            r = self._live.get(rid)
            if r is not None:
                self._release(r)
                out.append((rid, Completion(r.token_ids, r.logprobs, "abort", r.version)))
        return out

    def num_unfinished(self) -> int:
        return len(self._live)

    def unfinished_ids(self) -> list[str]:
        return list(self._live)

    # weights and memory

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy Hugging Face-named tensors into the model (all or some of them) and record ``version``.
        Refused while requests are in flight (abort them first, as with vLLM)."""
        if self.weights_asleep:
            raise RuntimeError(
                "update_weights() while the engine's weights are asleep: wake_up(['weights']) first"
            )
        self._check_idle("update_weights()", generating=False)
        if isinstance(named_tensors, (list, tuple)) and not named_tensors:
            raise ValueError("update_weights() needs the model's tensors, got none")
        self.model.load(named_tensors)
        self.version = version

    def sleep(self, level: int = 1) -> None:  # noqa: ARG002 - vLLM's signature
        self._check_idle("sleep()", generating=False)
        self.asleep = self.weights_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "weights" in tags:
            self.weights_asleep = False
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    # internals

    def _prefill(self, reqs: list[_Request]) -> torch.Tensor:
        """Logits after each request's prompt. Requests with the same prompt (a GRPO group's samples) share one
        forward: the first one's keys and values are copied into the others' slots."""
        row: dict[tuple[int, ...], int] = {}  # prompt -> its row among the distinct prompts
        index = [row.setdefault(tuple(r.prompt), len(row)) for r in reqs]
        if len(row) == len(reqs):
            return self._prefill_unique(reqs)
        leaders: dict[
            int, _Request
        ] = {}  # row -> the first request with that prompt (rows come in order)
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
        return logits[torch.tensor(index, device=logits.device)]

    def _prefill_unique(self, reqs: list[_Request]) -> torch.Tensor:
        """Logits after each request's prompt, prefilled in chunks of at most ~8k padded tokens."""
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
            out.append(
                self.model.forward(
                    tokens,
                    torch.arange(width, device=self.device),
                    self.k_cache,
                    self.v_cache,
                    slots,
                    lengths,
                )
            )
            i = j
        return torch.cat(out)

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """One token per request from its row of ``logits`` [m, V] (float32), with its log-probability under
        the distribution it was drawn from: temperature, then top-p (renormalized); greedy at temperature 0."""
        temps = torch.tensor([r.temperature for r in reqs], device=logits.device)
        greedy = temps == 0
        z = logits / torch.where(greedy, 1.0, temps)[:, None]
        top_p = torch.tensor([r.top_p for r in reqs], device=logits.device)
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
        if not r.ignore_eos and r.token_ids[-1] in self.stop_ids:
            return "stop"
        if (
            len(r.token_ids) >= r.max_tokens
            or len(r.prompt) + len(r.token_ids) >= self.max_model_len
        ):
            return "length"
        return None

    def _release(self, r: _Request) -> None:
        """Forget a request; the last running one moves into its slot (keys and values too), so the running
        requests stay packed in slots 0..n-1 and a decode step reads the cache as views, not a gather."""
        del self._live[r.rid]
        if r.slot < 0:
            return
        last = self._running.pop()
        if last is not r:
            self.k_cache[:, r.slot, :, : last.cached] = self.k_cache[:, last.slot, :, : last.cached]
            self.v_cache[:, r.slot, :, : last.cached] = self.v_cache[:, last.slot, :, : last.cached]
            last.slot = r.slot
            self._running[r.slot] = last
        r.slot = -1
