"""GPU memory of a plan, stage by stage: what each GPU holds with colocated roles resident or taking turns.

Colocated roles (the same device list) time-share their GPUs: in the generate stage the generators hold
their weights and KV cache while the trainer and reference are offloaded, in the train stage the reverse
(ROLL's time-division multiplexing). This module estimates, before anything is submitted, the peak
memory of every GPU with offload off (every role resident all the time) and on (each stage loads only
what it uses), from parameter counts (the model's config.json), dtypes, the optimizer, the parallel
layout and the engines' KV budget, and refuses a mapping whose peak exceeds ``cluster.gpu_memory_gb``.

What a rank holds comes from its worker class (``gpu_memory``: named parts in bytes, e.g. the trainer's
parameters, gradients, optimizer states, activations and a forward's activations); which parts each stage needs comes
from the pipeline class (``memory_stages``: stage -> {role: parts}). A pipeline without stages runs
everything at once, so offload changes nothing there. Estimates, not measurements: activations follow
Korthikanti et al. (34 bytes x sequence x micro-batch x hidden per layer in 16 bits, no recomputation)
and each process is charged a CUDA context; the -m gpu tests measure the real numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rollhpc.config import ConfigError, ExperimentConfig, import_object

GIB = 1 << 30
CUDA_CONTEXT_BYTES = 0.5 * GIB  # per process on a GPU: CUDA context, cuBLAS/NCCL workspaces (never offloaded)


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a Qwen2/Llama-style decoder (dense or MoE) from its Hugging Face config.json."""

    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_dense: int  # parameters of one layer outside the routed experts (attention, norms, dense or shared MLP)
    layer_experts: int  # parameters of one layer's routed experts (0 for a dense model)
    embedding: int
    head: int  # output layer (a copy of the embedding on the last stage when tied)
    tied: bool
    intermediate: int = 0  # a dense MLP's width (0 for MoE: its adapters are not counted)

    @property
    def total(self) -> int:
        """Every parameter once (a tied output layer is the embedding), as Hugging Face counts them."""
        head = 0 if self.tied else self.head
        return self.layers * (self.layer_dense + self.layer_experts) + self.embedding + head + self.hidden

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelShape":
        h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
        heads = int(hf["num_attention_heads"])
        kv = int(hf.get("num_key_value_heads") or heads)
        hd = int(hf.get("head_dim") or h // heads)
        bias = hf.get("model_type", "").startswith("qwen2")  # Qwen2's q/k/v projections carry biases
        attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (heads * hd + 2 * kv * hd if bias else 0)
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        if experts:
            inter = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
            shared = int(hf.get("shared_expert_intermediate_size") or 0)
            dense_mlp = h * experts + (3 * h * shared + h if shared else 0)  # router, shared expert and its gate
            routed = 3 * h * inter * experts
        else:
            dense_mlp, routed = 3 * h * int(hf["intermediate_size"]), 0
        intermediate = 0 if experts else int(hf["intermediate_size"])
        tied = bool(hf.get("tie_word_embeddings", False))
        return cls(hidden=h, layers=layers, vocab=vocab, heads=heads, kv_heads=kv, head_dim=hd,
                   layer_dense=attention + dense_mlp + 2 * h, layer_experts=routed, embedding=vocab * h,
                   head=vocab * h, tied=tied, intermediate=intermediate)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelShape | None":
        path = Path(model_dir).expanduser() / "config.json"
        return cls.from_hf(json.loads(path.read_text())) if path.is_file() else None


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}[dtype]


def megatron_stage_params(shape: ModelShape, tp: int, pp: int, ep: int, etp: int) -> int:
    """Parameters of a rank on the heaviest pipeline stage: its share of the layers (dense parts split by tp,
    routed experts by ep x etp), plus the embedding on the first stage and the output layer on the last."""
    return sum(megatron_stage_split(shape, tp, pp, ep, etp))


def megatron_stage_split(shape: ModelShape, tp: int, pp: int, ep: int, etp: int) -> tuple[int, int]:
    """``megatron_stage_params`` as (dense, routed experts): the distributed optimizer shards the first over the
    data-parallel group and the second over the (smaller) expert-data-parallel group."""
    layers = -(-shape.layers // pp)
    experts = layers * (shape.layer_experts // (ep * etp))
    body = layers * (shape.layer_dense // tp)
    first = shape.embedding // tp
    # the last stage's output layer: its own weights, or with pp > 1 a copy of the tied embedding
    last = (shape.head if not shape.tied or pp > 1 else 0) // tp + shape.hidden
    return body + (first + last if pp == 1 else max(first, last)), experts


def activation_bytes(shape: ModelShape, tp: int, pp: int, micro_batch: int, seq_len: int, dtype: int,
                     recompute: str = "none") -> int:
    """Activations of one forward-backward in flight (pp of them on the first stage under 1F1B), and the
    float32 logits and log-softmax of a micro-batch on the last.

    Per layer (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", for 16-bit
    activations, scaled by ``dtype / 2``): 34·s·b·h bytes outside attention's score matrices and 5·a·s²·b for them
    (megatron's local attention materializes them), both split over TP. ``recompute``: "selective" recomputes the
    scores in the backward (drops the 5·a·s²·b); "full" keeps only each layer's input (2·s·b·h, not split) and
    recomputes one layer at a time, whose full activations are then held once more."""
    layers = -(-shape.layers // pp)
    sbh = seq_len * micro_batch * shape.hidden
    outside = 34 * sbh * dtype // 2 // tp
    scores = 5 * shape.heads * seq_len * seq_len * micro_batch * dtype // 2 // tp
    if recompute == "none":
        held = layers * (outside + scores) * pp
    elif recompute == "selective":
        held = layers * outside * pp
    elif recompute == "full":
        held = layers * sbh * dtype * pp + outside + scores
    else:
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    logits = 2 * micro_batch * seq_len * (shape.vocab // tp) * 4
    return held + logits


@dataclass
class GpuGroup:
    """GPUs that hold the same roles in the same way (one line of the report)."""

    gpus: list[tuple[int, int, int]]  # (het group, node in it, GPU position on the node)
    parts: dict[str, dict[str, float]]  # role -> part -> bytes on each of these GPUs
    processes: int  # processes per GPU (each charged a CUDA context)
    roles: list[str] = field(default_factory=list)  # every role with a rank on these GPUs, estimated or not
    stages: dict[str, float] = field(default_factory=dict)  # stage -> bytes with offload on
    resident: float = 0.0  # bytes with offload off (every part of every role at once)

    @property
    def peak_on(self) -> float:
        return max(self.stages.values()) if self.stages else self.resident


@dataclass
class MemoryPlan:
    groups: list[GpuGroup]
    gpu_memory_gb: float
    unknown: list[str]  # roles whose memory could not be estimated, and why
    offload: bool = False  # pipeline.options.offload: colocated roles take turns

    def render(self) -> Iterator[str]:
        cap = f"cluster.gpu_memory_gb={self.gpu_memory_gb:g}" if self.gpu_memory_gb else \
            "cluster.gpu_memory_gb not set: nothing checked"
        yield f"GPU memory per GPU (estimate, GiB; {cap}; pipeline.options.offload={str(self.offload).lower()}):"
        for why in self.unknown:
            yield f"  {why}"
        for g in self.groups:
            if not g.parts:
                yield f"  {_where(g.gpus)}: {', '.join(g.roles)}: not estimated"
                continue
            yield f"  {_where(g.gpus)}: {', '.join(g.parts)} ({g.processes} process(es) per GPU)"
            for role, parts in g.parts.items():
                yield "    " + f"{role}: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
            yield f"    {'stage':<14} {'offload off':>12} {'offload on':>11}" + ("" if g.stages else "  (no turns to take)")
            for stage, on in g.stages.items():
                yield f"    {stage:<14} {g.resident / GIB:>12.1f} {on / GIB:>11.1f}"
            yield f"    {'peak':<14} {g.resident / GIB:>12.1f} {g.peak_on / GIB:>11.1f}" + self._verdict(g)

    def _verdict(self, g: GpuGroup) -> str:
        if not self.gpu_memory_gb:
            return ""
        cap = self.gpu_memory_gb * 1e9 / GIB
        if g.peak_on / GIB > cap:
            return f"  exceeds {cap:.1f} GiB even with offload"
        if g.resident / GIB > cap:
            return f"  fits {cap:.1f} GiB only with offload"
        return f"  fits {cap:.1f} GiB"

    def check(self) -> None:
        """ConfigError when some GPU's peak exceeds cluster.gpu_memory_gb: its stage peak with offload on
        (pipeline.options.offload), its resident total with it off."""
        if not self.gpu_memory_gb:
            return
        cap = self.gpu_memory_gb * 1e9
        for g in (g for g in self.groups if g.parts):  # what could not be estimated is not judged
            if not self.offload and g.resident > cap:
                hint = ("set pipeline.options.offload=true (the colocated roles then take turns: about "
                        f"{g.peak_on / GIB:.1f} GiB)" if g.peak_on <= cap else "give the roles more GPUs")
                raise ConfigError(
                    f"{_where(g.gpus)}: the colocated roles need about {g.resident / GIB:.1f} GiB per GPU held at "
                    f"once, more than cluster.gpu_memory_gb={self.gpu_memory_gb:g} GB ({cap / GIB:.1f} GiB); {hint}")
            if g.peak_on > cap:
                stage = max(g.stages, key=g.stages.get) if g.stages else "every stage"
                detail = "; ".join(f"{role}: " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in parts.items())
                                   for role, parts in g.parts.items())
                raise ConfigError(
                    f"{_where(g.gpus)}: the {stage} stage needs about {g.peak_on / GIB:.1f} GiB per GPU even with "
                    f"the colocated roles offloaded between stages, more than cluster.gpu_memory_gb={self.gpu_memory_gb:g} "
                    f"GB ({cap / GIB:.1f} GiB) ({detail}); give the roles more GPUs (tp, pp, ep), other devices, or "
                    "lower the generators' gpu_memory_utilization or micro_batch_size")


def _held(parts: dict[str, float]) -> float:
    """A role's bytes when all of it is resident: a forward's activations (``forward_*``) fit in the room
    its training activations take, so they are not added again."""
    return sum(v for k, v in parts.items() if not k.startswith("forward_"))


def _where(gpus: list[tuple[int, int, int]]) -> str:
    comps = sorted({c for c, _, _ in gpus})
    nodes = len({(c, n) for c, n, _ in gpus})
    return f"{len(gpus)} GPU(s) on {nodes} node(s) of het group {','.join(map(str, comps))}"


def seq_len_of(cfg: ExperimentConfig) -> int:
    """The longest row the roles see: the largest max_model_len among the roles' options (2048 if none)."""
    lengths = [getattr(r.options, "max_model_len", 0) for r in cfg.roles.values()]
    rollout = getattr(cfg.pipeline.options, "rollout", None)
    lengths.append(getattr(rollout, "max_model_len", 0) or 0)
    return max([n for n in lengths if isinstance(n, int)] + [0]) or 2048


def estimate(cfg: ExperimentConfig, plan: Any) -> MemoryPlan:  # plan: a WorldPlan
    """Per GPU group: each role's parts, each stage's total with offload on, and the total with it off."""
    seq_len = seq_len_of(cfg)
    gpu_bytes = cfg.cluster.gpu_memory_gb * 1e9
    per_rank: dict[str, dict[str, float] | None] = {}
    unknown = []
    for name, role in cfg.roles.items():
        if role.gpus_per_proc == 0:
            continue
        worker = import_object(role.worker, f"roles.{name}.worker")
        model_dir = getattr(role.options, "model_dir", None)
        shape = ModelShape.from_dir(model_dir) if isinstance(model_dir, str) else None
        parts = (worker.gpu_memory(role.options, role.layout(), shape, seq_len=seq_len, gpu_bytes=gpu_bytes)
                 if shape is not None else None)
        if parts is None:
            why = ("its options name no model_dir" if not isinstance(model_dir, str) else
                   f"the model's config.json is not on this machine ({model_dir})" if shape is None else
                   "its worker says nothing of its memory")
            unknown.append(f"{name}: not estimated: {why}")
            per_rank[name] = None
            continue
        per_rank[name] = {k: v / role.gpus_per_proc for k, v in parts.items()}  # spread over the rank's GPUs
    stages = import_object(cfg.pipeline.entry, "pipeline.entry").memory_stages
    # GPU (het group, node, position) -> roles with a rank on it; GPUs holding the same roles form one group
    holders: dict[tuple[int, int, int], list[str]] = {}
    for p in plan.ranks:
        for local in p.gpus:
            holders.setdefault((p.component, p.node, local), []).append(p.role)
    grouped: dict[tuple[str, ...], list[tuple[int, int, int]]] = {}
    for gid, roles in sorted(holders.items()):
        grouped.setdefault(tuple(roles), []).append(gid)
    staged = {r for loaded in (stages or {}).values() for r in loaded}
    groups = []
    for roles, gids in grouped.items():
        names = list(dict.fromkeys(roles))
        parts = {r: {k: v * roles.count(r) for k, v in per_rank[r].items()}  # all ranks of a role on a GPU
                 for r in names if per_rank.get(r) is not None}
        context = CUDA_CONTEXT_BYTES * len(roles)
        g = GpuGroup(gids, parts, len(roles), names)
        g.resident = context + sum(_held(p) for p in parts.values())
        # roles take turns only with another role on the same GPU (a generator rank beside no trainer stays)
        movable = {r for r in parts if r in staged} if len({r for r in names if r in staged}) > 1 else set()
        always = context + sum(_held(parts[r]) for r in parts if r not in movable)  # never offloaded
        for stage, loaded in (stages or {}).items() if movable else ():
            active = {r: ps for r, ps in loaded.items() if r in movable}
            if not active:
                continue
            g.stages[stage] = always + sum(parts[r].get(k, 0.0) for r, ps in active.items() for k in ps)
        groups.append(g)
    return MemoryPlan(groups, cfg.cluster.gpu_memory_gb, unknown, bool(getattr(cfg.pipeline.options, "offload", False)))
