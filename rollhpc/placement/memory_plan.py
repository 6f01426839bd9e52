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
everything at once, so offload changes nothing there. Two stages are the plan's own: ``startup``, the colocated
roles building in turns (engines first: vLLM profiles the free memory, then sleeps; then the others, each after
the earlier ones offloaded), and a weight sync's buckets, added to its stage (``IN_FLIGHT_BUCKETS`` slots of
``weight_sync_bucket_mb`` on trainer rank 0's GPU, a bucket's copy per CUDA IPC receiver there, two buckets on each
broadcast receiver's GPU: ``sync_bucket_bytes``). Parts in ``PINNED_PARTS`` stay on the GPU while their role is
offloaded. Estimates, not measurements: activations are counted op by op for megatron's local spec
(rollhpc.placement.activation_model, checked against bench/activation_bytes.py's saved-tensor bytes), each process
is charged a CUDA context; the -m gpu tests measure the real numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rollhpc.config import ConfigError, ExperimentConfig, import_spec
from rollhpc.placement import activation_model as am
from rollhpc.placement.device_mapping import WorldPlan, weight_sync_routing
from rollhpc.weight_sync.routing import BROADCAST, IN_FLIGHT_BUCKETS

GIB = 1 << 30
# per process on a GPU: CUDA context, cuBLAS/NCCL workspaces (never offloaded)
CUDA_CONTEXT_BYTES = 0.5 * GIB
# parts a worker reports that stay on the GPU while its role is offloaded (vLLM's sleep frees only its weights and KV
# cache pools): counted in every stage, and kept by an earlier role while a later one starts
PINNED_PARTS = ("driver_buffers", "cuda_graphs")
# config.json fields of the models the shipped configs name, for a plan made where the model is not (a login node
# before the download, CI): matched by the model directory's name, lower case, "-instruct" dropped
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}


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
    gated: bool = True  # a SwiGLU MLP (hidden_act silu, Qwen/Llama); False: a plain GELU MLP
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    experts: int = 0  # routed experts per MoE layer
    topk: int = 0  # experts each token is routed to
    moe_intermediate: int = 0  # one routed expert's FFN width
    shared_intermediate: int = 0  # the shared expert's FFN width (Qwen2-MoE; 0 when none)

    @property
    def total(self) -> int:
        """Every parameter once (a tied output layer is the embedding), as Hugging Face counts them."""
        head = 0 if self.tied else self.head
        return (
            self.layers * (self.layer_dense + self.layer_experts)
            + self.embedding
            + head
            + self.hidden
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelShape":
        h, layers, vocab = (
            int(hf["hidden_size"]),
            int(hf["num_hidden_layers"]),
            int(hf["vocab_size"]),
        )
        heads = int(hf["num_attention_heads"])
        kv = int(hf.get("num_key_value_heads") or heads)
        hd = int(hf.get("head_dim") or h // heads)
        # Qwen2's q/k/v projections carry biases
        bias = hf.get("model_type", "").startswith("qwen2")
        attention = (
            h * heads * hd
            + 2 * h * kv * hd
            + heads * hd * h
            + (heads * hd + 2 * kv * hd if bias else 0)
        )
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        if experts:
            inter = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
            shared = int(hf.get("shared_expert_intermediate_size") or 0)
            # router, shared expert and its gate
            dense_mlp = h * experts + (3 * h * shared + h if shared else 0)
            routed = 3 * h * inter * experts
        else:
            dense_mlp, routed, inter = 3 * h * int(hf["intermediate_size"]), 0, 0
        intermediate = 0 if experts else int(hf["intermediate_size"])
        tied = bool(hf.get("tie_word_embeddings", False))
        moe = dict(
            experts=experts,
            topk=int(hf.get("num_experts_per_tok") or 0),
            moe_intermediate=inter,
            shared_intermediate=int(hf.get("shared_expert_intermediate_size") or 0)
            if experts
            else 0,
        )
        return cls(
            hidden=h,
            layers=layers,
            vocab=vocab,
            heads=heads,
            kv_heads=kv,
            head_dim=hd,
            layer_dense=attention + dense_mlp + 2 * h,
            layer_experts=routed,
            embedding=vocab * h,
            head=vocab * h,
            tied=tied,
            intermediate=intermediate,
            gated=hf.get("hidden_act", "silu") == "silu",
            qk_norm=hf.get("model_type", "") in ("qwen3", "qwen3_moe"),
            **moe,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelShape | None":
        path = Path(model_dir).expanduser() / "config.json"
        return cls.from_hf(json.loads(path.read_text())) if path.is_file() else None

    @classmethod
    def known(cls, model_dir: str | Path) -> "ModelShape | None":
        """The shape of a model in ``KNOWN_MODELS`` named by the directory's last component, else None."""
        name = Path(model_dir).name.lower().removesuffix("-instruct")
        return cls.from_hf(KNOWN_MODELS[name]) if name in KNOWN_MODELS else None


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


def activation_bytes(
    shape: ModelShape,
    tp: int,
    pp: int,
    micro_batch: int,
    seq_len: int,
    dtype: int,
    recompute: str = "none",
    *,
    ep: int = 1,
    etp: int = 1,
) -> int:
    """Activations of one forward-backward in flight (pp of them on the first stage under 1F1B), what a
    backward re-materializes one layer at a time, and the last stage's head (logits over the vocabulary).

    Per layer, op by op (rollhpc.placement.activation_model: megatron-core's local spec, fitted to the saved
    tensors bench/activation_bytes.py counts): SwiGLU or GELU MLPs, GQA, MoE experts and their dispatcher, and
    ``recompute`` "none", "selective" (the core attention recomputed) or "full" (each layer from its input)."""
    layers = -(-shape.layers // pp)
    per_layer = sum(
        am.layer_bytes(shape, tp, micro_batch, seq_len, dtype, recompute, ep=ep, etp=etp).values()
    )
    transient = am.transient_bytes(
        shape, tp, micro_batch, seq_len, dtype, recompute, ep=ep, etp=etp
    )
    return int(
        layers * per_layer * pp + transient + am.head_bytes(shape, tp, micro_batch, seq_len, dtype)
    )


def forward_activation_bytes(
    shape: ModelShape,
    tp: int,
    micro_batch: int,
    seq_len: int,
    dtype: int,
    *,
    ep: int = 1,
    etp: int = 1,
) -> int:
    """A forward without autograd (reference, old log-probs): each layer's tensors live only while it runs, so one
    layer's worth (as a training forward would keep it, an upper bound) and the MoE dispatcher's buffers, and the
    whole head: its logits are not divided among the layers."""
    layer = sum(
        am.layer_bytes(shape, tp, micro_batch, seq_len, dtype, "none", ep=ep, etp=etp).values()
    )
    return int(
        layer
        + am.dispatch_buffer_bytes(
            shape, am.local_tokens(shape, tp, micro_batch * seq_len), dtype, ep, etp
        )
        + am.head_bytes(shape, tp, micro_batch, seq_len, dtype)
    )


@dataclass
class GpuGroup:
    """GPUs that hold the same roles in the same way (one line of the report)."""

    gpus: list[tuple[int, int, int]]  # (het group, node in it, GPU position on the node)
    parts: dict[str, dict[str, float]]  # role -> part -> bytes on each of these GPUs
    processes: int  # processes per GPU (each charged a CUDA context)
    # every role with a rank on these GPUs, estimated or not
    roles: list[str] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # stage -> bytes with offload on
    resident: float = 0.0  # bytes with offload off (every part of every role at once)
    # a weight sync's buckets on each of these GPUs (in weight_sync and resident)
    sync_buckets: float = 0.0

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
        cap = (
            f"cluster.gpu_memory_gb={self.gpu_memory_gb:g}"
            if self.gpu_memory_gb
            else "cluster.gpu_memory_gb not set: nothing checked"
        )
        yield f"GPU memory per GPU (estimate, GiB; {cap}; pipeline.options.offload={str(self.offload).lower()}):"
        for why in self.unknown:
            yield f"  {why}"
        for g in self.groups:
            if not g.parts:
                yield f"  {_where(g.gpus)}: {', '.join(g.roles)}: not estimated"
                continue
            sync = f"; a weight sync's buckets {g.sync_buckets / GIB:.1f}" if g.sync_buckets else ""
            yield f"  {_where(g.gpus)}: {', '.join(g.parts)} ({g.processes} process(es) per GPU{sync})"
            for role, parts in g.parts.items():
                yield (
                    "    " + f"{role}: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
                )
            yield f"    {'stage':<14} {'offload off':>12} {'offload on':>11}" + (
                "" if g.stages else "  (no turns to take)"
            )
            for stage, on in g.stages.items():
                yield f"    {stage:<14} {g.resident / GIB:>12.1f} {on / GIB:>11.1f}"
            yield (
                f"    {'peak':<14} {g.resident / GIB:>12.1f} {g.peak_on / GIB:>11.1f}"
                + self._verdict(g)
            )

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
                hint = (
                    "set pipeline.options.offload=true (the colocated roles then take turns: about "
                    f"{g.peak_on / GIB:.1f} GiB)"
                    if g.peak_on <= cap
                    else "give the roles more GPUs"
                )
                raise ConfigError(
                    f"{_where(g.gpus)}: the colocated roles need about {g.resident / GIB:.1f} GiB per GPU held at "
                    f"once, more than cluster.gpu_memory_gb={self.gpu_memory_gb:g} GB ({cap / GIB:.1f} GiB); {hint}"
                )
            if g.peak_on > cap:
                stage = max(g.stages, key=g.stages.get) if g.stages else "every stage"
                detail = "; ".join(
                    f"{role}: " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in parts.items())
                    for role, parts in g.parts.items()
                )
                raise ConfigError(
                    f"{_where(g.gpus)}: the {stage} stage needs about {g.peak_on / GIB:.1f} GiB per GPU even with "
                    f"the colocated roles offloaded between stages, more than cluster.gpu_memory_gb={self.gpu_memory_gb:g} "
                    f"GB ({cap / GIB:.1f} GiB) ({detail}); give the roles more GPUs (tp, pp, ep), other devices, or "
                    "lower the generators' gpu_memory_utilization or micro_batch_size"
                )


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


def shape_of(model_dir: object) -> tuple[ModelShape | None, str]:
    """A role's model shape: from its config.json, else from ``KNOWN_MODELS`` by the directory's name (and a note
    saying so: a plan made before the download), else None."""
    if not isinstance(model_dir, str):
        return None, ""
    shape = ModelShape.from_dir(model_dir)
    if shape is not None:
        return shape, ""
    known = ModelShape.known(model_dir)
    return known, (
        f"the shape of {Path(model_dir).name} from rollhpc's table of known models (no config.json at "
        f"{model_dir} here)"
        if known is not None
        else ""
    )


def _role_parts(
    cfg: ExperimentConfig, seq_len: int
) -> tuple[dict[str, dict[str, float] | None], list[str]]:
    """Each GPU role's parts per GPU (a rank's parts spread over its GPUs), or None with the reason in the list."""
    gpu_bytes = cfg.cluster.gpu_memory_gb * 1e9
    per_rank: dict[str, dict[str, float] | None] = {}
    unknown = []
    for name, role in cfg.roles.items():
        if role.gpus_per_proc == 0:
            continue
        worker = import_spec(role.worker, f"roles.{name}.worker")
        model_dir = getattr(role.options, "model_dir", None)
        shape, note = shape_of(model_dir)
        if note:
            unknown.append(f"{name}: {note}")
        parts = (
            worker.gpu_memory(
                role.options, role.layout(), shape, seq_len=seq_len, gpu_bytes=gpu_bytes
            )
            if shape is not None
            else None
        )
        if parts is None:
            why = (
                "its options name no model_dir"
                if not isinstance(model_dir, str)
                else f"the model's config.json is not on this machine ({model_dir})"
                if shape is None
                else "its worker says nothing of its memory"
            )
            unknown.append(f"{name}: not estimated: {why}")
            per_rank[name] = None
            continue
        # spread over the rank's GPUs
        per_rank[name] = {k: v / role.gpus_per_proc for k, v in parts.items()}
    return per_rank, unknown


def sync_bucket_bytes(cfg: ExperimentConfig, plan: WorldPlan) -> dict[tuple[int, int, int], float]:
    """GPU -> the bytes a weight sync's buckets take on it (``weight_sync.slots``, ``weight_sync.broadcast``):

    * trainer rank 0's GPU: ``IN_FLIGHT_BUCKETS`` reused slots, each of ``weight_sync_bucket_mb`` or of the
      largest tensor when that is larger (a tensor gets a slot of its own size), and the tensor being packed (a
      TP-gathered or HF-converted copy, alive while it is copied in); the same for the CUDA IPC and the NCCL path;
    * each CUDA IPC receiver (on that same GPU): its own copy of the bucket it loads, one slot's size;
    * each broadcast receiver's first GPU: ``IN_FLIGHT_BUCKETS`` buckets (the one it hands on, the one arriving).
    Empty without a weight sync to GPUs or a bucket size."""
    options = cfg.pipeline.options
    mb = (
        options.get("weight_sync_bucket_mb")
        if isinstance(options, dict)
        else getattr(options, "weight_sync_bucket_mb", None)
    )
    routing = weight_sync_routing(cfg, plan) if mb else None
    if routing is None or not any(r.place is not None for r in routing.routes):
        return {}
    train = cfg.roles["train"].options
    shape, _ = shape_of(getattr(train, "model_dir", None))
    largest = (
        0.0
        if shape is None
        else float(
            max(shape.vocab * shape.hidden, 2 * shape.intermediate * shape.hidden)
            * dtype_bytes(getattr(train, "dtype", "bfloat16"))
        )
    )
    slot = max(float(mb * 2**20), largest)
    source = next(p for p in plan.ranks if p.role == "train" and p.group_rank == 0)
    home = (source.component, source.node, source.gpus[0])
    out = {home: IN_FLIGHT_BUCKETS * slot + largest}
    for r in routing.routes:
        if r.place is not None:
            out[r.place] = out.get(r.place, 0.0) + (
                IN_FLIGHT_BUCKETS * slot if r.transport == BROADCAST else slot
            )
    return out


def startup_bytes(parts: dict[str, dict[str, float]], order: list[str], base: float) -> float:
    """The start-up's peak on a GPU whose roles build in turns (``order``), each after the earlier ones slept
    or offloaded: while a role builds it holds every part but activations (a generator its whole KV budget as it
    profiles, a trainer its parameters, gradient buffers and optimizer states), beside what the earlier roles keep
    (``PINNED_PARTS``: what vLLM's sleep and megatron's offload leave) and ``base`` (CUDA contexts, roles that
    never take turns)."""
    peak, kept = base, 0.0
    for role in order:
        built = sum(v for k, v in parts[role].items() if "activations" not in k)
        peak = max(peak, base + kept + built)
        kept += sum(v for k, v in parts[role].items() if k in PINNED_PARTS)
    return peak


def startup_order(cfg: ExperimentConfig) -> list[str]:
    """The order colocated roles build in (rollhpc.controller.startup's turns): the roles whose workers measure the
    free memory as they start first (``measures_free_memory``: vLLM counts everything in use against its budget,
    so it profiles before the others load, then sleeps), then the others, each in the config's order."""

    def measures(name: str) -> bool:
        worker = import_spec(cfg.roles[name].worker, f"roles.{name}.worker")
        return bool(getattr(worker, "measures_free_memory", False))

    return sorted(cfg.roles, key=lambda name: not measures(name))


def _group(
    roles: tuple[str, ...],
    gids: list[tuple[int, int, int]],
    per_rank: dict[str, Any],
    stages: dict[str, dict[str, tuple[str, ...]]] | None,
    buckets: float,
    order: list[str],
) -> GpuGroup:
    """One GPU group's parts, resident total and per-stage totals (``startup`` first, ``buckets`` of a weight
    sync added to its stage on the GPUs that hold them)."""
    names = list(dict.fromkeys(roles))
    parts = {
        r: {k: v * roles.count(r) for k, v in per_rank[r].items()}  # all ranks of a role on a GPU
        for r in names
        if per_rank.get(r) is not None
    }
    context = CUDA_CONTEXT_BYTES * len(roles)
    g = GpuGroup(gids, parts, len(roles), names, sync_buckets=buckets)
    g.resident = context + sum(_held(p) for p in parts.values()) + buckets
    staged = {r for loaded in (stages or {}).values() for r in loaded}
    # roles take turns only with another role on the same GPU (a generator rank beside no trainer stays)
    movable = (
        {r for r in parts if r in staged} if len({r for r in names if r in staged}) > 1 else set()
    )
    always = context + sum(_held(parts[r]) for r in parts if r not in movable)  # never offloaded
    if movable:
        g.stages["startup"] = startup_bytes(parts, [r for r in order if r in movable], always)
    for stage, loaded in (stages or {}).items() if movable else ():
        active = {r: ps for r, ps in loaded.items() if r in movable}
        if not active:
            continue
        held = {(r, k) for r, ps in active.items() for k in ps} | {
            (r, k) for r in movable for k in PINNED_PARTS
        }
        g.stages[stage] = (
            always
            + sum(parts[r].get(k, 0.0) for r, k in held)
            + (buckets if stage == "weight_sync" else 0.0)
        )
    return g


def estimate(cfg: ExperimentConfig, plan: WorldPlan) -> MemoryPlan:
    """Per GPU group: each role's parts, each stage's total with offload on (a start-up in turns first), and the
    total with it off."""
    per_rank, unknown = _role_parts(cfg, seq_len_of(cfg))
    stages = import_spec(cfg.pipeline.entry, "pipeline.entry").memory_stages
    sync = sync_bucket_bytes(cfg, plan)
    # GPU (het group, node, position) -> roles with a rank on it; GPUs holding the same roles (and the same part in
    # a weight sync) form one group
    holders: dict[tuple[int, int, int], list[str]] = {}
    for p in plan.ranks:
        for local in p.gpus:
            holders.setdefault((p.component, p.node, local), []).append(p.role)
    grouped: dict[tuple[tuple[str, ...], float], list[tuple[int, int, int]]] = {}
    for gid, roles in sorted(holders.items()):
        grouped.setdefault((tuple(roles), sync.get(gid, 0.0)), []).append(gid)
    order = startup_order(cfg)
    groups = [
        _group(roles, gids, per_rank, stages, buckets, order)
        for (roles, buckets), gids in grouped.items()
    ]
    return MemoryPlan(
        groups,
        cfg.cluster.gpu_memory_gb,
        unknown,
        bool(getattr(cfg.pipeline.options, "offload", False)),
    )
