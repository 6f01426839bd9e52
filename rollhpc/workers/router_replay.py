"""Routing replay in the Megatron trainer: each MoE layer's top-k experts taken from given routes instead of
its router's own choice, through megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``).

Why: the same token takes other experts in vLLM than in Megatron (kernels, precision, batch composition), so
the trainer's log-probs belong to another network than the one that sampled, and MoE importance ratios blow up.
Replaying fixes the experts; the router's gate values still come from the trainer's own logits over them (so the
router keeps its gradient). Two sources (``router_replay`` of the train role):

- r2: the trainer's own routes, recorded in its old-log-prob forward and replayed in the training forwards of
  the same rows: the mini-batch updates then move the experts' weights, not which experts a token takes.
- r3: the generator's routes, given with the batch as ``routes`` [B, W, moe_layers, top_k] (global expert ids;
  position i holds the experts that token i's hidden state was routed to).

Routes are rows x positions on our side and megatron's routers see ``[s, b]`` flattened s-major, one router per
MoE layer of a chunk: ``RouteReplayer`` maps between the two per micro-batch (its ``rows``), per chunk (its
layers, by their global number: pipeline stages and virtual stages hold different ones). Under full recompute the
backward re-runs each layer's forward: those take the routes queued by the matching forward (``ReplayRouter``).
Under sequence parallelism (a MoE model at tp > 1) a TP rank's routers see its 1/tp of the sequence: it replays
that part of the routes, and what it records is gathered over the TP group (every rank keeps whole rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from rollhpc.batch import Batch
from rollhpc.models.megatron_cpu import import_megatron

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # noqa: E402
from megatron.core.transformer.moe.router_replay import (  # noqa: E402
    RouterReplay,
    RouterReplayAction,
)

RouteMode = Literal["off", "record", "replay"]
# which forward of a step: the old log-probs (r2 records there), a reference's, or the training forwards
Forward = Literal["old_logprob", "reference", "train"]
ROUTE_DTYPE = np.int16  # expert ids: up to 32,767 experts, a quarter of int64's bytes
# megatron's top-k of a router's scores: (scores, k, num_groups, group_topk) -> (values, indices)
TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class ReplayRouter(RouterReplay):
    """megatron's per-layer ``RouterReplay``, which also keeps the experts it used last (``used``) in every
    mode, queues replay targets only for forwards that will run backward, and serves a recompute inside the
    backward (full recompute) from that queue without the caller switching the action."""

    def __init__(self) -> None:
        super().__init__()
        self.used: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # [tokens] bool: the targets that are real routes
        # (token, layer) routes replayed, and of those the ones whose experts the router would not have chosen
        self.replayed = 0
        self.differing = 0
        self.counting = True  # off in a reference's forward: its router is another network's

    def set_target_indices(
        self, topk_indices: torch.Tensor, valid: torch.Tensor | None = None
    ) -> None:
        self.target_topk_idx = topk_indices
        self.valid = valid
        if torch.is_grad_enabled():  # a forward-only pass has no backward to pop them
            self.replay_backward_list.append(topk_indices)

    def _count(self, scores: torch.Tensor, topk: int, compute: TopK, *groups: int | None) -> None:
        """Compare the replayed experts with the ones the router's own top-k takes on these scores."""
        own = compute(scores, topk, *groups)[1]
        target = self.target_topk_idx.to(own.device)
        same = (own.sort(-1).values == target.sort(-1).values).all(-1)
        valid = torch.ones_like(same) if self.valid is None else self.valid.to(same.device)
        self.replayed += int(valid.sum())
        self.differing += int((valid & ~same).sum())

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        in_backward = torch._C._current_graph_task_id() != -1
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and in_backward:
            self.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
            try:
                out = super().get_replay_topk(
                    scores, topk, num_groups, group_topk, default_compute_topk
                )
            finally:
                self.router_replay_action = RouterReplayAction.REPLAY_FORWARD
        else:
            out = super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
        if not in_backward:
            self.used = out[1]
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self.counting:
                assert default_compute_topk is not None
                with torch.no_grad():
                    self._count(scores, topk, default_compute_topk, num_groups, group_topk)
        return out


def moe_layer_index(num_layers: int, moe_layer_freq: int | Sequence[int]) -> dict[int, int]:
    """Global layer number (1-based, megatron's ``layer_number``) -> its index among the MoE layers, for
    megatron's ``moe_layer_freq`` (every n-th layer, or a 0/1 pattern)."""
    if isinstance(moe_layer_freq, int):
        pattern = [int(i % moe_layer_freq == 0) for i in range(num_layers)]
    else:
        pattern = list(moe_layer_freq)
    numbers = [i + 1 for i, moe in enumerate(pattern) if moe]
    return {n: k for k, n in enumerate(numbers)}


class RouteReplayer:
    """The routers of a rank's model chunks and what their next forwards do: ``off`` (their own routing),
    ``record`` (their own routing, kept per row and position in ``recorded``: r2), ``replay`` (the micro-batch's
    ``routes``). ``before``/``after`` wrap each chunk's forward on a micro-batch."""

    def __init__(self, chunks: Sequence[torch.nn.Module], source: str):
        self.source = source  # r2: the routes recorded in the old-log-prob forward; r3: the batch's
        config = chunks[0].config
        index = moe_layer_index(config.num_layers, config.moe_layer_freq)
        self.top_k = int(config.moe_router_topk)
        # sequence parallelism: (this rank's part, parts) of each sequence its routers see
        self.split = (
            (parallel_state.get_tensor_model_parallel_rank(), config.tensor_model_parallel_size)
            if config.sequence_parallel
            else (0, 1)
        )
        self.moe_layers = len(index)
        self.routers: dict[int, list[tuple[int, ReplayRouter]]] = {}
        for chunk in chunks:
            mine = []
            for layer in chunk.decoder.layers:
                router = getattr(getattr(layer, "mlp", None), "router", None)
                if router is None or router.router_replay is None:
                    continue
                replay = ReplayRouter()
                router.router_replay = replay
                mine.append((index[layer.layer_number], replay))
            self.routers[id(chunk)] = mine
        # megatron's global list held the routers' own instances: ours are driven per chunk, not through it
        RouterReplay.global_router_replay_instances[:] = [
            r for rs in self.routers.values() for _, r in rs
        ]
        self.mode: RouteMode = "off"
        self.recorded: np.ndarray | None = (
            None  # [B, W, moe_layers, top_k], this rank's layers filled
        )
        self.recorded_tokens: np.ndarray | None = None  # the rows they were recorded for

    @classmethod
    def of(cls, chunks: Sequence[torch.nn.Module], source: str, role: str) -> RouteReplayer | None:
        """The replayer of a role's ``router_replay`` (none: None); an error on a model without MoE layers."""
        if source == "none":
            return None
        if not chunks[0].config.num_moe_experts:
            raise ValueError(
                f"role {role!r}: router_replay={source} replays the routes of MoE layers, and this model "
                "has none (a dense model routes nothing: set router_replay: none)"
            )
        return cls(chunks, source)

    def prepare(self, batch: Batch, forward: Forward) -> Batch:
        """Start the mode of the next forwards (``forward`` of a step, as this role's source wants) and return the
        batch they run on, with the ``routes`` they replay. r3: the batch's own (the generator's); r2: recorded in
        the old-log-prob forward (which records) and replayed in training (a reference forward routes itself)."""
        tokens = np.asarray(batch["tokens"])
        if forward == "old_logprob":
            self.take_counts()  # a new step: its forwards' counts start here
        for replay in self._all():
            replay.counting = forward != "reference"
        if self.source == "r3":
            if "routes" not in batch.data:
                raise RuntimeError(
                    "router_replay=r3 replays the generator's routes, and this batch has none: the generate "
                    "role must return them (an engine that records its routes)"
                )
            self.start("replay")
            return batch
        if forward == "old_logprob":
            self.start("record", tokens)
            return batch
        if forward == "reference" or "old_logprob" not in batch.data:
            # a reference routes itself; an on-policy step (no old log-probs) routes as it would record
            self.start("off")
            return batch
        routes = self.recorded_for(tokens)
        self.start("replay")
        return Batch({**batch.data, "routes": routes}, dict(batch.meta))

    def start(self, mode: RouteMode, tokens: np.ndarray | None = None) -> None:
        """The next forwards' mode; ``record`` keeps routes for ``tokens`` [B, W] (the batch's rows)."""
        self.mode = mode
        action = {
            "off": None,
            "record": RouterReplayAction.RECORD,
            "replay": RouterReplayAction.REPLAY_FORWARD,
        }[mode]
        for replay in self._all():
            replay.clear_indices()
            replay.used = None
            if action is None:
                replay.clear_router_replay_action()
            else:
                replay.set_router_replay_action(action)
        if mode == "record":
            assert tokens is not None
            self.recorded_tokens = np.array(tokens, copy=True)
            shape = (*tokens.shape, self.moe_layers, self.top_k)
            self.recorded = np.zeros(shape, dtype=ROUTE_DTYPE)

    def recorded_for(self, tokens: np.ndarray) -> np.ndarray:
        """The routes recorded (r2) for these rows: an error unless the last recording was of the same rows."""
        if self.recorded is None or self.recorded_tokens is None:
            raise RuntimeError(
                "router_replay=r2 replays the routes of the old-log-prob forward, and none was recorded: "
                "the pipeline must compute the trainer's old log-probs of the batch it trains on"
            )
        if not np.array_equal(self.recorded_tokens, tokens):
            raise RuntimeError(
                "router_replay=r2: the rows to train on are not the rows whose old log-probs were recorded"
            )
        return self.recorded

    def before(self, chunk: torch.nn.Module, part: Mapping[str, torch.Tensor], length: int) -> None:
        """Set each of the chunk's routers' targets from the micro-batch's ``routes`` (replay); ``length``: the
        sequence length the forward runs at (the micro-batch's, padded to a multiple of the sequence split)."""
        if self.mode != "replay":
            return
        # [b, s, moe_layers, top_k]; -1 where no route was recorded (a row's last token, padding): experts
        # 0..k-1 there, whose outputs nothing reads, left out of the comparison
        routes = part["routes"].to(torch.int64)
        routes = torch.nn.functional.pad(
            routes, (0, 0, 0, 0, 0, length - routes.shape[1]), value=-1
        )
        known = (routes[..., 0, 0] >= 0) & part["keep"][:, None]
        routes = torch.where(routes >= 0, routes, torch.arange(self.top_k, device=routes.device))
        # s-major, as megatron flattens its [s, b] tokens; this rank's part of the sequence
        rank, parts = self.split
        mine = slice(rank * length // parts, (rank + 1) * length // parts)
        valid = known.transpose(0, 1)[mine].reshape(-1)
        for k, replay in self._of(chunk):
            layer = routes[:, :, k, :].transpose(0, 1)[mine].reshape(-1, self.top_k)
            replay.set_target_indices(layer, valid)

    def after(self, chunk: torch.nn.Module, part: Mapping[str, torch.Tensor]) -> None:
        """Keep what each of the chunk's routers chose for the micro-batch's rows (record)."""
        if self.mode != "record" or self.recorded is None:
            return
        tokens = part["tokens"]
        b, s = tokens.shape
        keep = part["keep"].cpu().numpy()
        rows = part["rows"].cpu().numpy()[keep]
        for k, replay in self._of(chunk):
            assert replay.used is not None
            used = replay.used
            # this rank's part of the sequence: gathered whole, as every TP rank keeps it
            if self.split[1] > 1:
                used = gather_from_sequence_parallel_region(used, tensor_parallel_output_grad=False)
            used = used.reshape(-1, b, self.top_k)[:s].transpose(0, 1).cpu().numpy()
            self.recorded[rows, :s, k, :] = used[keep].astype(ROUTE_DTYPE)

    def take_counts(self) -> tuple[float, float]:
        """(routes replayed, routes whose experts the router's own top-k would not have taken) since the last
        call (a step's old-log-prob and training forwards), over this rank's layers and tokens; the counters start
        again at 0."""
        replayed = sum(r.replayed for r in self._all())
        differing = sum(r.differing for r in self._all())
        for r in self._all():
            r.replayed = r.differing = 0
        return float(replayed), float(differing)

    def _of(self, chunk: torch.nn.Module) -> list[tuple[int, ReplayRouter]]:
        """The routers of a chunk, or of the chunk a wrapper holds (megatron's DDP and Float16Module keep the
        wrapped model as ``module``), with their MoE-layer indices."""
        while id(chunk) not in self.routers:
            chunk = chunk.module
        return self.routers[id(chunk)]

    def _all(self) -> list[ReplayRouter]:
        return [r for rs in self.routers.values() for _, r in rs]
