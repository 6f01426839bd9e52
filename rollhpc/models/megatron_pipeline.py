"""Pipeline parallelism for the megatron roles: model chunks, megatron's schedules, stage-crossing steps.

A rank of a role with ``pp`` stages (and ``vpp`` virtual stages per rank) holds a list of model chunks:
one ``GPTModel`` per virtual stage, each with its own layers (megatron numbers them globally, so the
first stage of a pp=2, vpp=2 model of 4 layers holds layers 1 and 3). Without virtual stages the list
has one chunk; at pp=1 that chunk is the whole model. Everything here works on that list, so the
trainer has one code path for every layout (which rows make each micro-batch: ``workers.megatron_batches``):

* ``run_schedule``: forward (and backward) of every micro-batch through megatron's own schedule
  (``get_forward_backward_func``: no pipelining, 1F1B, or interleaved 1F1B); the loss function runs on
  the last stage only, and what it returns comes back there;
* ``allreduce_tied_embedding_grads``: with tied embeddings the first stage's embedding and the last
  stage's output layer are two copies of one weight: their gradients are summed before the step;
* ``export_pipeline_hf_weights``: every stage's weights in Hugging Face names, streamed to the first
  stage's exporting rank, for weight sync, digests and conversion;
* ``chunks_sharded_state_dict`` / ``load_chunks_state``: the dist-checkpoint view of all chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rollhpc.models.lora import adapter_sync_tensors, merged_hf_weights
from rollhpc.models.megatron_cpu import import_megatron
from rollhpc.models.megatron_hf import exporting_rank

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402


def configure_chunks(chunks: Sequence[torch.nn.Module]) -> None:
    """Settings the schedules need: losses as returned (the policy loss already divides by global
    token counts), shapes sent ahead of each activation (micro-batches differ in rows and length),
    no batched p2p on gloo (it has no coalesced send/recv)."""
    for chunk in chunks:
        config = chunk.config
        config.calculate_per_token_loss = True
        config.variable_seq_lengths = True
        config.batch_p2p_comm = torch.cuda.is_available()


def run_schedule(
    chunks: Sequence[torch.nn.Module],
    parts: Sequence[Any],
    forward: Callable[[torch.nn.Module, Any], torch.Tensor],
    loss: Callable[[Any, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
    *,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Run ``parts`` (one object per micro-batch) through megatron's schedule for this layout.

    ``forward(chunk, part)`` calls a chunk (the schedule has set its input on later stages) and returns
    its output; ``loss(part, output)`` runs on the last stage and returns (the loss to back-propagate,
    a dict of what to keep). Returns the dicts, in micro-batch order, on the last stage; [] elsewhere.
    Collective over the pipeline group: every stage passes the same number of parts, in the same order."""
    if not parts:
        return []
    configure_chunks(chunks)
    iterators = [iter(parts) for _ in chunks]

    def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
        part = next(data_iterator)
        output = forward(model, part)

        def loss_func(output_tensor: torch.Tensor):
            value, kept = loss(part, output_tensor)
            return value, torch.tensor(1, dtype=torch.int), kept

        return output, loss_func

    schedule = get_forward_backward_func()
    # shapes travel with each activation (variable_seq_lengths): seq_length/micro_batch_size are unused
    return schedule(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=list(chunks) if len(chunks) > 1 else chunks[0],
        num_microbatches=len(parts),
        seq_length=1,
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _stage_chunk(chunks: Sequence[torch.nn.Module], attr: str) -> torch.nn.Module | None:
    return next((c for c in chunks if getattr(c, attr)), None)


def allreduce_tied_embedding_grads(chunks: Sequence[torch.nn.Module]) -> None:
    """Sum the gradients of the two copies of a tied embedding (first stage's input embedding, last
    stage's output layer), as megatron's ``finalize_model_grads`` does for its DDP-wrapped models."""
    if (
        ps.get_pipeline_model_parallel_world_size() == 1
        or not chunks[0].share_embeddings_and_output_weights
    ):
        return
    if not ps.is_rank_in_embedding_group(ignore_virtual=True):
        return
    chunk = _stage_chunk(chunks, "pre_process") or _stage_chunk(chunks, "post_process")
    weight = chunk.shared_embedding_or_output_weight()
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad, group=ps.get_embedding_group())
    weight.grad = grad


def export_pipeline_hf_weights(
    chunks: Sequence[torch.nn.Module],
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    adapters_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``export_hf_weights`` over every pipeline stage: the first stage's exporting rank (TP rank 0,
    expert-parallel rank 0) yields the whole model, its own stage's tensors first, then each later
    stage's, received one tensor at a time from that stage's exporting rank. Collective like
    ``export_hf_weights``, over the pipeline group too: every rank of the exporting replica iterates
    to the end; on the others it yields nothing. ``adapters_only``: a LoRA policy's adapters instead, as
    a generator that merges them takes them (``rollhpc.models.lora.adapter_sync_tensors``)."""
    local = _stage_weights(chunks, vocab_size, tp_group, adapters_only)
    if (
        not (dist.is_available() and dist.is_initialized())
        or ps.get_pipeline_model_parallel_world_size() == 1
    ):
        yield from local
        return
    stages = ps.get_pipeline_model_parallel_world_size()
    group_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    exporting = exporting_rank(chunks[0], tp_group)
    if ps.get_pipeline_model_parallel_rank() != 0:
        _send_to_first_stage(local, group_ranks[0], exporting)
        return
    yield from local
    if exporting:
        device = next(chunks[0].parameters()).device
        for source in group_ranks[1:stages]:
            yield from _receive_stage(source, device)


def _stage_weights(
    chunks: Sequence[torch.nn.Module],
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    adapters_only: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's tensors in HF names: the adapters alone, or the base with the adapters merged in (a LoRA
    policy's weights are the model the generators serve)."""
    if adapters_only:
        exporting_here = exporting_rank(chunks[0], tp_group)
        for chunk in chunks:
            yield from adapter_sync_tensors(chunk, tp_group, exporting_here)
        return
    for chunk in chunks:
        yield from merged_hf_weights(chunk, vocab_size, tp_group)


def _send_to_first_stage(
    local: Iterator[tuple[str, torch.Tensor]], first: int, exporting: bool
) -> None:
    """A later stage's tensors to the first stage's exporting rank (global rank ``first``), each after a header
    (name, shape, dtype); a None header ends them. Items come only on the exporting rank; the others take
    part in the gathers."""
    for name, tensor in local:
        dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=first)
        dist.send(tensor.contiguous(), dst=first)
    if exporting:
        dist.send_object_list([None], dst=first)


def _receive_stage(source: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``_send_to_first_stage`` sends from global rank ``source``, one tensor at a time."""
    while True:
        header: list[tuple[str, tuple[int, ...], torch.dtype] | None] = [None]
        dist.recv_object_list(header, src=source)
        if header[0] is None:
            return
        name, shape, dtype = header[0]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=source)
        yield name, tensor


def chunks_sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """megatron's sharded state dict of all chunks (keys of chunk i prefixed ``i.`` when there are
    several): the checkpoint's tensors are global, so a pp/vpp checkpoint loads at any other layout."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {
        f"{i}.{k}": v
        for i, chunk in enumerate(chunks)
        for k, v in chunk.sharded_state_dict().items()
    }


def load_chunks_state(chunks: Sequence[torch.nn.Module], state: dict[str, Any]) -> None:
    """Put ``state`` (loaded against ``chunks_sharded_state_dict``) into the chunks, strictly."""
    if len(chunks) == 1:
        chunks[0].load_state_dict(state, strict=True)
        return
    for i, chunk in enumerate(chunks):
        prefix = f"{i}."
        chunk.load_state_dict(
            {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True
        )
