"""Hugging Face weights into and out of a ``GPTModel`` built by ``models.megatron_gpt``, on the map of
``models.hf_weight_map``.

* ``load_hf_weights(model, hf_state_dict, tp_rank, tp_size)``: copies this rank's shard of every HF
  tensor into the model (its pipeline stage's layers, its expert-parallel rank's experts). The state
  dict may be any ``Mapping`` (e.g. one that reads tensors lazily off disk): one entry is read at a time.
* ``export_hf_weights(model, vocab_size)``: the inverse, for weight sync to an HF-named generator (vLLM)
  and checkpoint conversion: inside the running TP group (and expert-TP / expert-parallel groups for
  MoE), all-gathers one parameter at a time and yields ``(hf_name, full tensor)`` on TP rank 0. It gathers
  within one pipeline stage (``megatron_pipeline.export_pipeline_hf_weights`` streams every stage's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from rollhpc.models.hf_weight_map import (
    LORA_ATTRIBUTE,
    VALUE_HEAD,
    Arch,
    WeightMapping,
    _split_expert_name,
    weight_map,
    shard_hf_weight,
    unshard_to_hf,
)
from rollhpc.models.megatron_cpu import import_megatron

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core import parallel_state  # noqa: E402


def _group_coords(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in a process group; (0, 1) without torch.distributed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _moe_experts(model: torch.nn.Module) -> torch.nn.Module | None:
    """The experts module of the model's first MoE layer (every layer is one), or None for dense models."""
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            return experts
    return None


def _hf_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters that have Hugging Face counterparts: all but a critic's value head and LoRA
    adapters (``rollhpc.models.lora``: exported on their own, under PEFT's names)."""
    return {
        n: p
        for n, p in model.named_parameters()
        if not n.startswith(VALUE_HEAD + ".") and f".{LORA_ATTRIBUTE}." not in n
    }


def model_weight_map(model: torch.nn.Module) -> tuple[list[WeightMapping], list[WeightMapping]]:
    """(this rank's map, the whole model's map) for a model built by ``build_gpt_model``: this pipeline
    stage's layers, embedding and output, this expert-parallel rank's experts."""
    c = model.config
    layers = [layer.layer_number - 1 for layer in model.decoder.layers]
    arch = Arch(
        num_layers=c.num_layers,
        tie_word_embeddings=bool(model.share_embeddings_and_output_weights),
        qkv_bias=bool(c.add_qkv_bias),
        qk_norm=bool(c.qk_layernorm),
        num_experts=c.num_moe_experts or 0,
        shared_expert=bool(c.moe_shared_expert_intermediate_size),
    )
    experts = None
    if arch.num_experts:
        moe = next((layer.mlp for layer in model.decoder.layers), None)
        experts = list(moe.local_expert_indices) if moe is not None else []
    local = weight_map(
        arch,
        layers=layers,
        experts=experts,
        embedding=bool(model.pre_process),
        output=bool(model.post_process),
    )
    return local, weight_map(arch)


def _default_tp_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``tp_group``, or megatron's TP group where torch.distributed is initialized and none is given."""
    if tp_group is None and dist.is_available() and dist.is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return tp_group


def _check_mapped(
    params: dict[str, torch.nn.Parameter], table: list[WeightMapping], what: str
) -> None:
    """Raise unless every parameter with an HF counterpart has a mapping in ``table``."""
    missing = set(params) - {w.megatron for w in table}
    if missing:
        raise KeyError(f"megatron parameters without an HF {what}: {sorted(missing)}")


def _check_hf_names(
    hf_state_dict: Mapping[str, torch.Tensor],
    table: list[WeightMapping],
    whole: list[WeightMapping],
    tied: bool,
) -> None:
    """Raise if the checkpoint lacks a tensor this rank's ``table`` needs, or holds one the ``whole`` model
    has no parameter for (``lm_head.weight`` of a tied checkpoint and rotary frequencies are ignored)."""
    absent = sorted(n for w in table for n in w.hf if n not in hf_state_dict)
    if absent:
        raise KeyError(
            f"HF checkpoint lacks {len(absent)} tensor(s): {absent[:8]}{' ...' if len(absent) > 8 else ''}"
        )
    expected = {n for w in whole for n in w.hf} | ({"lm_head.weight"} if tied else set())
    unused = sorted(
        n for n in hf_state_dict if n not in expected and not n.endswith("rotary_emb.inv_freq")
    )
    if unused:
        raise KeyError(
            f"HF tensors with no megatron parameter: {unused[:8]}{' ...' if len(unused) > 8 else ''}"
        )


def load_hf_weights(
    model: torch.nn.Module,
    hf_state_dict: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    *,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> None:
    """Copy TP rank ``tp_rank``'s shard of every HF tensor into ``model`` (built by ``build_gpt_model``).
    Routed experts are cut for the expert-TP rank (default: the model's expert-TP group). Raises if a
    megatron parameter has no source, a shape differs, or an HF tensor belongs to no parameter of the
    model (``lm_head.weight`` of a tied checkpoint is ignored). Reads ``hf_state_dict[name]`` once per
    use, one parameter at a time."""
    config = model.config
    params = _hf_params(model)
    table, whole = model_weight_map(model)
    _check_mapped(params, table, "source")
    if etp_rank is None or etp_size is None:
        experts = _moe_experts(model)
        etp_rank, etp_size = _group_coords(experts.tp_group) if experts is not None else (0, 1)
    _check_hf_names(hf_state_dict, table, whole, bool(model.share_embeddings_and_output_weights))
    with torch.no_grad():
        for w in table:
            rank, size = (etp_rank, etp_size) if w.expert else (tp_rank, tp_size)
            sources = [hf_state_dict[n] for n in w.hf]
            shard = shard_hf_weight(
                w.layout,
                sources,
                rank,
                size,
                num_query_groups=config.num_query_groups,
                padded_vocab=model.vocab_size,
            )
            param = params[w.megatron]
            if shard.shape != param.shape:
                raise ValueError(
                    f"{w.megatron}: shard of {w.hf} (shapes {[tuple(t.shape) for t in sources]}) has "
                    f"shape {tuple(shard.shape)}, the model expects {tuple(param.shape)}"
                )
            param.copy_(shard)
            del sources, shard


def _gather(local: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [local]
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return shards


def export_hf_weights(
    model: torch.nn.Module, vocab_size: int, tp_group: dist.ProcessGroup | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every HF tensor of ``model`` (built by ``build_gpt_model``), gathered
    over the tensor-parallel group (default: megatron's ``parallel_state`` TP group; without an
    initialized ``torch.distributed`` or at TP size 1 nothing is gathered). ``vocab_size``: the HF
    (unpadded) vocab size, from ``config.json``. MoE: routed experts are gathered over the model's
    expert-TP group, then over its expert-parallel group (every expert comes out once).

    Collective: every TP rank (for MoE with ep > 1: every rank of the expert-parallel group too) must
    iterate this generator to the end, in step (it all-gathers one parameter per step); only TP rank 0
    (for MoE: TP rank 0 of expert-parallel rank 0) yields, the other ranks yield nothing. Memory stays bounded by one
    parameter's full tensor(s) (times ep for routed experts): each is gathered, unsharded, yielded and
    dropped before the next. Yielded tensors are detached, fresh (not views of the model's parameters when
    TP > 1; at TP 1 the non-fused ones may share storage with them: copy before the next optimizer step if
    kept). Tied embeddings: ``lm_head.weight`` is not yielded (HF ties it to ``model.embed_tokens.weight``).
    One pipeline stage's tensors only."""
    tp_group = _default_tp_group(tp_group)
    tp_rank, tp_size = _group_coords(tp_group)
    experts = _moe_experts(model)
    etp_group, ep_group = (
        (experts.tp_group, experts.ep_group) if experts is not None else (None, None)
    )
    etp_rank, etp_size = _group_coords(etp_group)
    ep_rank = _group_coords(ep_group)[0]
    config = model.config
    params = _hf_params(model)
    table, _ = model_weight_map(model)
    _check_mapped(params, table, "name")
    per_rank = len(experts.local_experts) if experts is not None else 0
    kw = dict(
        num_query_groups=config.num_query_groups,
        num_attention_heads=config.num_attention_heads,
        vocab_size=vocab_size,
    )
    for w in table:
        if getattr(params[w.megatron], "shared", False):
            continue  # the last pipeline stage's copy of a tied embedding: the first stage exports it
        local = params[w.megatron].detach()
        if not w.expert:
            shards = _gather(local, tp_group, tp_size)
            if tp_rank == 0 and ep_rank == 0:
                yield from unshard_to_hf(w.layout, shards, w.hf, **kw).items()
            del shards, local
            continue
        full = unshard_to_hf(w.layout, _gather(local, etp_group, etp_size), w.hf, **kw)
        del local
        yield from _gather_experts(full, ep_group, per_rank, exporting=tp_rank == 0)
        del full


def _gather_experts(
    full: dict[str, torch.Tensor],
    ep_group: dist.ProcessGroup | None,
    per_rank: int,
    *,
    exporting: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One routed expert's HF tensors (``full``, TP-gathered) from every expert-parallel rank, yielded under
    their global expert names on expert-parallel rank 0 of the ``exporting`` TP rank; a collective over
    ``ep_group`` (``per_rank``: experts per expert-parallel rank)."""
    ep_rank, ep_size = _group_coords(ep_group)
    for name, tensor in full.items():
        gathered = _gather(tensor, ep_group, ep_size)
        if exporting and ep_rank == 0:
            # name carries this rank's global expert index; rank k's copy is that index + (k - ep_rank) * per_rank
            head, idx, tail = _split_expert_name(name)
            for k, t in enumerate(gathered):
                yield f"{head}{idx + (k - ep_rank) * per_rank}{tail}", t
        del gathered


def exporting_rank(model: torch.nn.Module, tp_group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``export_hf_weights`` yields on this rank (TP rank 0, and expert-parallel rank 0 for MoE)."""
    tp_group = _default_tp_group(tp_group)
    experts = _moe_experts(model)
    return _group_coords(tp_group)[0] == 0 and (
        experts is None or _group_coords(experts.ep_group)[0] == 0
    )


def weights_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over named tensors in name order: each name, dtype, shape and bytes. Equal digests of two models'
    ``export_hf_weights`` mean bitwise-equal models whatever their layouts."""
    h = hashlib.sha256()
    for name, t in sorted(
        ((n, t.detach().cpu().contiguous()) for n, t in named), key=lambda x: x[0]
    ):
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
