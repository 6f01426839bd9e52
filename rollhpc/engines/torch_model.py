"""The decoder that ``engine: torch`` (``rollhpc.engines.torch_engine``) runs: its weights and its forward.

Why a module of its own: the engine's scheduling (KV cache slots, continuous batching, sampling) and the model's
math change for different reasons; kept apart, each reads top to bottom, and a model family (Qwen2-MoE's routed
experts next to the dense Qwen2 / Llama MLP) is added here without touching the engine.

Models: Qwen2 and Llama-style dense decoders (``model_type`` qwen2 or llama) and Qwen2-MoE (qwen2_moe, every layer
a sparse MoE block: a softmax router's top-k experts, each a SwiGLU, plus the sigmoid-gated shared expert), default
RoPE, no sliding window; anything else is refused when the engine starts. For MoE models the forward also returns
the experts each position was routed to (routing replay: ``Completion.routes``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["SUPPORTED", "DecoderModel", "LayerWeights", "MoeWeights"]

SUPPORTED = ("qwen2", "llama", "qwen2_moe")


def _check_config(config: dict) -> dict:
    """Refuse what the model cannot run (naming what to use instead); returns the RoPE parameters."""
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
    if model_type == "qwen2_moe":
        # every layer a MoE block: what the trainer's weight map (rollhpc.models.hf_weight_map) supports
        if config.get("mlp_only_layers"):
            raise ValueError(
                f"engine=torch runs Qwen2-MoE with every layer MoE, not mlp_only_layers="
                f"{config['mlp_only_layers']}: use engine=vllm"
            )
        if int(config.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(
                f"engine=torch runs Qwen2-MoE with every layer MoE, not decoder_sparse_step="
                f"{config['decoder_sparse_step']}: use engine=vllm"
            )
        if int(config.get("num_experts") or 0) < 1:
            raise ValueError("engine=torch: a qwen2_moe config needs num_experts >= 1")
    return rope


class DecoderModel:
    """The decoder's weights (q/k/v and gate/up fused for fewer, larger matmuls) and its forward."""

    def __init__(self, config: dict, dtype: torch.dtype, device: torch.device, max_len: int):
        rope = _check_config(config)
        model_type = config["model_type"]
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.hidden = int(config["hidden_size"])
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.bias = (
            model_type == "qwen2"
            or (model_type == "qwen2_moe" and bool(config.get("qkv_bias", True)))
            or bool(config.get("attention_bias", False))
        )
        # MoE (qwen2_moe): experts per layer, experts per token, renormalised top-k weights, a shared expert
        self.moe = model_type == "qwen2_moe"
        self.experts = int(config.get("num_experts") or 0) if self.moe else 0
        self.top_k = int(config.get("num_experts_per_tok") or 0) if self.moe else 0
        self.norm_topk = bool(config.get("norm_topk_prob", False))
        self.shared_expert = int(config.get("shared_expert_intermediate_size") or 0) > 0
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
        self.w: dict[str, torch.Tensor] = {}  # embed, norm, head
        self.layer_w: list[LayerWeights] = []

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) of one position's routes; None for a dense model."""
        return (self.layers, self.top_k) if self.moe else None

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
        get = self._served
        self.layer_w = []
        for i in range(self.layers):
            prefix = f"model.layers.{i}."
            moe = (
                MoeWeights.read(get, f"{prefix}mlp.", self.experts, self.shared_expert)
                if self.moe
                else None
            )
            self.layer_w.append(LayerWeights.fused(get, prefix, self.bias, moe))
        embed = get("model.embed_tokens.weight")
        head = self.raw.get("lm_head.weight", embed) if self.tied else get("lm_head.weight")
        self.w = {"embed": embed, "norm": get("model.norm.weight"), "head": head}

    def _served(self, name: str) -> torch.Tensor:
        """The tensor the model runs with: as loaded, plus B A where a LoRA adapter covers it."""
        if name not in self.raw:
            raise ValueError(f"engine=torch: the checkpoint has no {name}")
        adapter = self.adapters.get(name[: -len(".weight")]) if name.endswith(".weight") else None
        if adapter is None:
            return self.raw[name]
        a, b = adapter
        return (self.raw[name].float() + b @ a).to(self.dtype)

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [m, V] (float32) of the last position of each row, and for a MoE model the routes of every
        position it ran: the top-k expert ids [m, t, MoE layers, k] (int64), per MoE layer in layer order (None
        for a dense model).

        Prefill (``lengths`` given): ``tokens`` [m, P] right-padded prompts, ``positions`` [P]; keys and
        values of positions 0..P-1 go to each row's slot (padding writes positions the row's later tokens
        overwrite before they are attended to). Decode (``lengths`` None): ``tokens`` [m, 1] at per-row
        ``positions`` [m]; each row attends to its slot's positions 0..position.
        """
        m, t = tokens.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        if lengths is not None:  # prefill: one position per column
            cos, sin = cos[None, :, None], sin[None, :, None]
        else:  # decode: one position per row, which sees its slot's positions 0..position
            cos, sin = cos[:, None, None], sin[:, None, None]
            span = torch.arange(int(positions.max()) + 1, device=tokens.device)
            visible = (span[None, :] <= positions[:, None])[:, None, None]
        x = F.embedding(tokens, self.w["embed"])  # [m, t, H]
        routes: list[torch.Tensor] = []
        for li, lw in enumerate(self.layer_w):
            qkv = F.linear(self._norm(x, lw.ln1), lw.qkv, lw.qkv_b)
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(m, t, nh, hd), cos, sin)
            k = self._rope(k.view(m, t, nkv, hd), cos, sin)
            v = v.view(m, t, nkv, hd)
            if lengths is not None:
                out = attend_prefill(q, k, v, k_cache[li], v_cache[li], slots)
            else:
                out = attend_decode(q, k, v, k_cache[li], v_cache[li], positions, visible)
            x = x + F.linear(out.to(x.dtype).reshape(m, t, nh * hd), lw.o)
            if lw.moe is None:
                gate, up = F.linear(self._norm(x, lw.ln2), lw.gate_up).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, lw.down)
            else:
                mixed, chosen = self._moe(self._norm(x, lw.ln2), lw.moe)
                x = x + mixed
                routes.append(chosen.view(m, t, -1))
        last = x[torch.arange(m, device=x.device), lengths - 1] if lengths is not None else x[:, 0]
        logits = F.linear(self._norm(last, self.w["norm"]), self.w["head"]).float()
        return logits, torch.stack(routes, dim=2) if routes else None

    def _moe(self, h: torch.Tensor, moe: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen2-MoE's sparse block on ``h`` [m, t, H] (normed): the router's top-k experts of each position,
        their SwiGLU outputs weighted by the (renormalised when ``norm_topk_prob``) softmax probabilities, plus
        the shared expert gated by a sigmoid. Returns the output [m, t, H] and the chosen ids [m * t, k].

        Each expert runs on the positions routed to it only (one host sync for the counts per layer)."""
        flat = h.reshape(-1, h.shape[-1])
        probs = F.linear(flat, moe.router).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [n, k]
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(h.dtype).flatten()
        order = chosen.flatten().argsort()  # (position, k) pairs grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=self.experts).tolist()
        out = torch.zeros_like(flat)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            rows = pairs // self.top_k
            gate, up = F.linear(flat[rows], moe.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, moe.down[e]) * weights[pairs, None]
            out.index_add_(0, rows, y)
        if moe.shared_gate_up is not None:
            gate, up = F.linear(flat, moe.shared_gate_up).chunk(2, dim=-1)
            shared = F.linear(F.silu(gate) * up, moe.shared_down)
            out = out + torch.sigmoid(F.linear(flat, moe.shared_gate)) * shared
        return out.view_as(h), chosen


@dataclass
class MoeWeights:
    """One Qwen2-MoE block's weights: the router [E, H], each expert's gate/up (fused) and down, and the shared
    expert's (None when the config has none) with its gate [1, H]."""

    router: torch.Tensor
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    shared_gate_up: torch.Tensor | None
    shared_down: torch.Tensor | None
    shared_gate: torch.Tensor | None

    @classmethod
    def read(
        cls, get: Callable[[str], torch.Tensor], mlp: str, experts: int, shared: bool
    ) -> MoeWeights:
        """The block under ``mlp`` ("model.layers.3.mlp."), each tensor read with ``get`` (HF's per-expert names
        ``experts.{e}.gate_proj.weight``)."""

        def gate_up(prefix: str) -> torch.Tensor:
            return torch.cat([get(f"{prefix}gate_proj.weight"), get(f"{prefix}up_proj.weight")])

        se = f"{mlp}shared_expert."
        return cls(
            router=get(f"{mlp}gate.weight"),
            gate_up=[gate_up(f"{mlp}experts.{e}.") for e in range(experts)],
            down=[get(f"{mlp}experts.{e}.down_proj.weight") for e in range(experts)],
            shared_gate_up=gate_up(se) if shared else None,
            shared_down=get(f"{se}down_proj.weight") if shared else None,
            shared_gate=get(f"{mlp}shared_expert_gate.weight") if shared else None,
        )


@dataclass
class LayerWeights:
    """One decoder layer's weights as the forward uses them: q/k/v and gate/up fused; a MoE layer has ``moe``
    instead of the dense MLP's ``gate_up`` and ``down``."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: torch.Tensor
    qkv_b: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    moe: MoeWeights | None = None

    @classmethod
    def fused(
        cls,
        get: Callable[[str], torch.Tensor],
        prefix: str,
        bias: bool,
        moe: MoeWeights | None = None,
    ) -> LayerWeights:
        """The layer under ``prefix`` ("model.layers.3."), each tensor read with ``get``; ``moe``: its MoE block
        (then it has no dense MLP)."""
        qkv = [f"{prefix}self_attn.{x}_proj" for x in "qkv"]
        mlp = f"{prefix}mlp."
        dense = moe is None
        return cls(
            ln1=get(f"{prefix}input_layernorm.weight"),
            ln2=get(f"{prefix}post_attention_layernorm.weight"),
            qkv=torch.cat([get(f"{x}.weight") for x in qkv]),
            qkv_b=torch.cat([get(f"{x}.bias") for x in qkv]) if bias else None,
            o=get(f"{prefix}self_attn.o_proj.weight"),
            gate_up=torch.cat([get(f"{mlp}gate_proj.weight"), get(f"{mlp}up_proj.weight")])
            if dense
            else None,
            down=get(f"{mlp}down_proj.weight") if dense else None,
            moe=moe,
        )


def attend_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention over the prompts ``q``, ``k``, ``v`` [m, t, heads, hd]; their keys and values are
    written to positions 0..t-1 of each row's slot (``slots`` [m]) of one layer's cache. Returns [m, t, nh, hd]."""
    t = q.shape[1]
    k_cache[slots, :, :t] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[slots, :, :t] = v.transpose(1, 2).to(v_cache.dtype)
    out = F.scaled_dot_product_attention(  # [m, nh, t, hd]
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def attend_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """One new token per row (``q``, ``k``, ``v`` [m, 1, heads, hd]) at ``positions`` [m]: its key and value
    go to the row's slot of one layer's cache, and it attends to the slot's positions where ``visible``
    [m, 1, 1, span]. The running requests hold slots 0..m-1 in order (TorchGenerator keeps them packed).
    Returns [m, nkv, nh // nkv, hd]: the query heads in order."""
    m, _, nh, hd = q.shape
    nkv = k.shape[2]
    span = visible.shape[-1]
    rows = torch.arange(m, device=q.device)
    k_cache[rows, :, positions] = k[:, 0].to(k_cache.dtype)
    v_cache[rows, :, positions] = v[:, 0].to(v_cache.dtype)
    keys, values = k_cache[:m, :, :span], v_cache[:m, :, :span]  # views [m, nkv, span, hd]
    # the heads sharing a key/value head act as that head's queries: no copy of the cache per head.
    # Plain matmuls: torch's CPU SDPA with a mask takes ~2x longer at these shapes
    scores = torch.matmul(q.view(m, nkv, nh // nkv, hd).float(), keys.transpose(-1, -2))
    probs = (scores * hd**-0.5).masked_fill_(~visible, -math.inf).softmax(-1)
    return torch.matmul(probs, values)
