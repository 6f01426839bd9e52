"""A megatron role's batch cut into micro-batches: which rows go together, how wide each is, and which rows of a
mini-batch can have a gradient at all.

Everything here is numpy and torch on one rank's rows, so a test can check the cuts without a megatron model;
the one collective a cut may need (the largest count over the role, under expert parallelism) is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from rollhpc.algo.objective import LossConfig
from rollhpc.batch import Batch, TrainingBatch


def micro_batches(
    rows: int, micro_batch_size: int, pp: int = 1, interleaved: bool = False
) -> list[np.ndarray]:
    """Row indices of each micro-batch of ``rows`` rows, at most ``micro_batch_size`` each. megatron's
    interleaved schedule needs at least ``pp`` micro-batches, a whole number of groups of ``pp``, and
    micro-batches of one shape (it does not send shapes ahead): there the count is rounded up and every
    micro-batch gets the same number of rows, ``-1`` marking a padding row (give it a zero loss mask and
    drop its outputs)."""
    if rows < 1:
        return []
    count = math.ceil(rows / micro_batch_size)
    index = np.arange(rows)
    if not interleaved:
        return list(np.array_split(index, count))
    count = max(pp, math.ceil(count / pp) * pp)
    size = math.ceil(rows / count)
    index = np.concatenate([index, np.full(count * size - rows, -1)])
    return list(index.reshape(count, size))


def token_budget_micro_batches(ends: np.ndarray, budget: int) -> list[np.ndarray]:
    """Positions into ``ends`` (each row's token count, sorted longest first) of each micro-batch when one may hold
    ``budget`` tokens, counted as its rows x its longest row (rows are right-padded to that, so padding costs like
    tokens): rows taken greedily in order, a row longer than the budget alone. Longest first keeps the few long rows
    together and packs the many short ones into large micro-batches, where a fixed row count would pad short rows
    to a long one's width, or run long rows many at a time."""
    out, start = [], 0
    while start < len(ends):
        size = max(1, budget // max(int(ends[start]), 1))
        out.append(np.arange(start, min(start + size, len(ends))))
        start += size
    return out


def micro_batch_index(
    n: int,
    ends: np.ndarray | None,
    full: int,
    *,
    pp: int,
    interleaved: bool,
    micro_batch_size: int,
    max_tokens: int,
    local_shapes: bool,
    role_max: Callable[[list[float]], list[float]],
) -> list[np.ndarray]:
    """Positions (into the rows' order; -1 a padding row) of each micro-batch: ``micro_batch_size`` rows, or
    with a token budget ``max_tokens`` as many as it holds. ``ends``: each row's token count, longest first, where
    this rank shapes its micro-batches alone (``local_shapes``: training without expert parallelism); else None:
    every row at the batch's ``full`` width.

    Under the token budget, rows of unequal length pack greedily (``token_budget_micro_batches``); the
    interleaved schedule's one shape gets as many rows as the budget holds at the batch's cut. The stages of a
    pipeline hold the same rows and compute the same micro-batches. Under expert parallelism the MoE token
    dispatch is a collective over other DP ranks, which hold other rows: the ranks agree on the count and the
    rows per micro-batch by ``role_max`` (an all-reduce of the largest), padding with -1 rows where they hold
    fewer."""
    if max_tokens and ends is not None and not interleaved:
        return token_budget_micro_batches(ends, max_tokens)
    width = int(ends.max(initial=2)) if ends is not None else full
    size = max(1, max_tokens // width) if max_tokens else micro_batch_size
    if local_shapes:
        return micro_batches(n, size, pp, interleaved)
    count, most = (int(v) for v in role_max([math.ceil(n / size), n]))
    if interleaved:
        count = max(pp, math.ceil(count / pp) * pp)
    rows = max(1, math.ceil(most / count))
    return list(np.concatenate([np.arange(n), np.full(count * rows - n, -1)]).reshape(count, rows))


def micro_batch_parts(
    batch: Batch,
    with_mask: bool,
    *,
    device: torch.device,
    interleaved: bool,
    local_shapes: bool,
    index: Callable[[int, np.ndarray | None, int], list[np.ndarray]],
) -> list[dict[str, torch.Tensor]]:
    """The batch's micro-batches as tensors on ``device``; padding rows (the interleaved schedule needs whole
    groups of pp micro-batches) get a zero loss mask and ``keep`` False. ``index(n, ends, full)``: the rows of
    each micro-batch (``micro_batch_index`` for the rank's layout and options).

    With the loss mask (training), rows go into micro-batches longest first and each micro-batch is cut
    after its last loss token: rows are right-padded to the batch's longest, and under causal attention
    the columns after a micro-batch's last loss token change none of its loss terms, so a batch of mixed
    lengths costs its tokens, not rows x longest. (The interleaved schedule needs one shape: there the
    cut is the batch's.) Forward-only calls keep the full width: their outputs are ``[B, L-1]``; so does a
    rank that does not shape its micro-batches alone (``local_shapes`` False)."""
    order = np.arange(len(batch))
    ends = None
    if with_mask and local_shapes:
        ends = loss_ends(batch)
        order = np.argsort(-ends, kind="stable")
    full = batch["tokens"].shape[1]
    # the interleaved schedule's one width
    width = int(ends.max(initial=2)) if ends is not None else None
    parts = []
    for idx in index(len(batch), None if ends is None else ends[order], full):
        keep = idx >= 0
        rows = order[np.where(keep, idx, 0)]
        if ends is not None and not interleaved:
            width = max(int(ends[rows].max()), 2)
        parts.append(
            micro_batch_tensors(batch, rows, keep, width, with_mask=with_mask, device=device)
        )
    return parts


def loss_ends(batch: Batch) -> np.ndarray:
    """Tokens each row needs: through its last loss position's target."""
    mask = np.asarray(batch["loss_mask"]) > 0
    return np.where(mask.any(1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1), 0) + 1


# what a forward reads besides the loss's inputs: the tokens, and the experts to replay (rollhpc.workers.router_replay)
FORWARD_INPUTS = ("tokens", "routes")


def micro_batch_tensors(
    batch: Batch,
    rows: np.ndarray,
    keep: np.ndarray,
    width: int | None,
    *,
    with_mask: bool,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One micro-batch's arrays (the batch's ``rows``, cut to ``width`` columns) as tensors on ``device``; rows
    not in ``keep`` (padding) get a zero loss mask. Without the mask (forward only): the ``FORWARD_INPUTS`` alone.
    ``rows``: each micro-batch row's row of the batch."""
    full = batch["tokens"].shape[1]
    part = {
        k: torch.as_tensor(cut_columns(np.asarray(v)[rows], width, full), device=device)
        for k, v in batch.data.items()
        if with_mask or k in FORWARD_INPUTS
    }
    if with_mask and not keep.all():
        part["loss_mask"] = part["loss_mask"] * torch.as_tensor(keep[:, None], device=device)
    part["tokens"] = part["tokens"].long()
    part["keep"] = torch.as_tensor(keep, device=device)
    part["rows"] = torch.as_tensor(
        rows, device=device
    )  # the batch's row of each (routing replay's record)
    return part


def cut_columns(rows: np.ndarray, width: int | None, full: int) -> np.ndarray:
    """``rows`` cut to ``width`` token columns: ``[b, full]`` tokens to ``width``, ``[b, full - 1]`` per-position
    arrays (masks, log-probs, advantages) to ``width - 1``; anything else (per-row values) as it is."""
    if width is None or rows.ndim < 2 or width >= full:
        return rows
    if rows.shape[1] == full:
        return rows[:, :width]
    return rows[:, : width - 1] if rows.shape[1] == full - 1 else rows


def mini_batch_rows(batch: Batch, mini: np.ndarray, trained: np.ndarray) -> Batch:
    """The rows ``trained`` of ``batch``; with none (every row of the mini-batch ``mini`` skipped), its first row
    with no loss token: zero gradients (not none) keep the optimizer's step."""
    if len(trained):
        return Batch({k: np.asarray(v)[trained] for k, v in batch.data.items()})
    rows = Batch({k: np.asarray(v)[mini[:1]] for k, v in batch.data.items()})
    rows.data["loss_mask"] = np.zeros_like(np.asarray(rows["loss_mask"]))
    return rows


def rows_with_gradient(
    batch: TrainingBatch, rows: np.ndarray, loss_config: LossConfig
) -> np.ndarray:
    """The rows of ``rows`` whose loss can have a gradient: with no KL or entropy term, a row whose loss
    tokens all have advantage 0 contributes exactly zero (clipped or not, -A * ratio is 0)."""
    # (a KL with coefficient 0 is still reported)
    if loss_config.entropy_coef > 0 or batch.ref_logprob is not None:
        return rows
    adv = np.asarray(batch.advantage)[rows]
    mask = np.asarray(batch.loss_mask)[rows] > 0
    live = (adv != 0) & mask if adv.ndim == 2 else (adv != 0) & mask.any(1)
    return rows[live.reshape(len(rows), -1).any(1)]
