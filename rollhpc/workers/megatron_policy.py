"""Train and reference roles on megatron-core: a ``GPTModel`` built from a Hugging Face checkpoint.

Each rank of the role joins a torch.distributed world of the role's ranks (gloo on CPU, NCCL on GPU;
rendezvous address from role rank 0 over the role's MPI communicator), then megatron's parallel state
with the role's TP/CP/EP/DP layout; the layout's data-parallel rank must equal megatron's, which is
how the controller's DP split and megatron's gradient groups agree.

The trainer takes batches of padded token rows (prompt + response) with a loss mask over response
targets, runs the policy loss of ``rollhpc.algo.losses`` in micro-batches with gradients summed over
data-parallel ranks (denominators are global, so DP=2 gives the DP=1 gradient), and exports its weights
in Hugging Face names, bucketed, for the generators. The reference role is the same model frozen; the critic
(PPO) is the same trunk with a value head.

Left out here: pipeline parallelism (needs megatron's pipeline schedules: refused with a clear error),
context parallelism on CPU, megatron's distributed optimizer (torch AdamW is used; megatron's optimizer
is CUDA-only), sequence packing.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rollhpc.algo.objective import LossConfig
from rollhpc.batch import Batch
from rollhpc.workers.base import Collect, Dispatch, Worker, WorkerContext, register

log = logging.getLogger("rollhpc.megatron")


def init_role_distributed(ctx: WorkerContext, timeout_s: float = 600.0) -> None:
    """torch.distributed over this role's ranks, rendezvous published by role rank 0 over MPI."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    comm = ctx.role_comm
    address = None
    if comm.Get_rank() == 0:
        host = os.environ.get("ROLLHPC_DIST_HOST") or socket.gethostname()
        with socket.socket() as s:
            s.bind(("", 0))
            address = (host, s.getsockname()[1])
    host, port = comm.bcast(address, root=0)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timedelta(seconds=timeout_s))


class MegatronPolicyWorker(Worker):
    """Shared by the train and reference roles: model construction and log-probabilities."""

    trainable = False

    @dataclass(kw_only=True)
    class Options:
        model_dir: str  # Hugging Face checkpoint (config.json + safetensors)
        micro_batch_size: int = 16  # rows per forward/backward
        dtype: Literal["float32", "bfloat16"] = "float32"
        threads: int = 0  # torch intra-op threads on CPU (0: leave torch's default)

        def __post_init__(self) -> None:
            if self.micro_batch_size < 1:
                raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")

    def __init__(self, ctx: WorkerContext, options: Options):
        super().__init__(ctx, options)
        import torch

        if options.threads:
            torch.set_num_threads(options.threads)
        layout = ctx.layout
        if layout is None:
            raise RuntimeError("the megatron roles need the role's parallel layout in their context")
        if layout.pp > 1:
            raise NotImplementedError(f"role {ctx.role!r}: pipeline parallelism (pp={layout.pp}) is not supported by "
                                      "this trainer yet; use tp/dp (and ep for MoE)")
        model_dir = Path(options.model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"role {ctx.role!r}: {model_dir} has no config.json (options.model_dir must be "
                                    "a Hugging Face checkpoint directory)")
        init_role_distributed(ctx)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from rollhpc.models import megatron_cpu
        from rollhpc.models.megatron_gpt import _hf_dict, build_gpt_model, load_hf_weights

        megatron_cpu.enable_cpu_megatron()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp, order=layout.order)
        if parallel_state.get_data_parallel_rank() != ctx.coords.dp_rank:
            raise RuntimeError(f"megatron puts rank {ctx.group_rank} at dp rank {parallel_state.get_data_parallel_rank()}"
                               f" but the role layout says {ctx.coords.dp_rank}: rank orders disagree")
        model_parallel_cuda_manual_seed(ctx.seed + 1000 * ctx.coords.pp_rank)
        self.hf_config = _hf_dict(model_dir)
        self.vocab_size = int(self.hf_config["vocab_size"])
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[options.dtype]
        self.model = build_gpt_model(self.hf_config, params_dtype=dtype)
        load_hf_weights(self.model, _load_safetensors(model_dir), parallel_state.get_tensor_model_parallel_rank(),
                        layout.tp)
        if torch.cuda.is_available():
            self.model.cuda()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.device = next(self.model.parameters()).device
        if not self.trainable:
            self.model.requires_grad_(False)
            self.model.eval()

    def _forward(self, tokens: Any, with_entropy: bool = False):
        """(logprob, entropy) of every next token: ``[b, L-1]`` each, from ``tokens [b, L]``."""
        import torch

        from rollhpc.models.vocab_parallel import token_logprobs

        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
        logits = self.model(tokens, positions, None)  # [b, L, V_padded / tp]
        return token_logprobs(logits[:, :-1], tokens[:, 1:], self.vocab_size, tp_rank=self.tp_rank,
                              tp_size=self.ctx.layout.tp, tp_group=self.tp_group, with_entropy=with_entropy)

    @register(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        """log p(token) of every next token under the current weights: ``{"logprob": [b, L-1] float32}``."""
        import torch

        out = []
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(0, len(batch), self.options.micro_batch_size):
                logp, _ = self._forward(batch["tokens"][start:start + self.options.micro_batch_size])
                out.append(logp.float().cpu().numpy())
        self.model.train(was_training)
        width = batch["tokens"].shape[1] - 1
        return Batch({"logprob": np.concatenate(out) if out else np.zeros((0, width), np.float32)})


class _WeightChannelMixin:
    """The sending end of ``weight_sync.broadcast``: trainer rank 0 hosts the rendezvous and broadcasts."""

    @register(Dispatch.RANK_ZERO)
    def open_weight_channel(self) -> tuple[str, int]:
        from rollhpc.weight_sync.broadcast import open_store

        self._store = open_store()
        return os.environ.get("ROLLHPC_DIST_HOST") or socket.gethostname(), int(self._store.port)

    @register(Dispatch.RANK_ZERO)
    def join_weight_channel(self, world: int) -> None:
        from rollhpc.weight_sync.broadcast import WeightBroadcast

        self._channel = WeightBroadcast(0, world, "", 0, store=self._store, device=self.device)

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def broadcast_weights(self, bucket_mb: float = 64.0) -> int | None:
        """Gather the weights over TP (first DP replica) and broadcast them from rank 0; returns bytes sent."""
        from rollhpc.models.megatron_gpt import export_hf_weights
        from rollhpc.weight_sync.buckets import pack_buckets

        if self.ctx.coords.edp_rank != 0:  # one replica; with EP its expert shards span several DP ranks
            return None
        named = export_hf_weights(self.model, self.vocab_size, self.tp_group)
        if self.ctx.group_rank != 0:
            for _ in named:  # the other TP ranks take part in the gathers only
                pass
            return None
        return self._channel.send(pack_buckets(named, int(bucket_mb * (1 << 20))))


class MegatronReferenceWorker(MegatronPolicyWorker):
    """The frozen initial policy: log-probabilities for the KL term."""


class MegatronTrainWorker(_WeightChannelMixin, MegatronPolicyWorker):
    trainable = True

    @dataclass(kw_only=True)
    class Options(MegatronPolicyWorker.Options):
        lr: float = 1e-5
        weight_decay: float = 0.0
        betas: tuple[float, float] = (0.9, 0.999)
        grad_clip: float = 1.0  # global gradient norm cap (0: off)
        mini_batches: int = 1  # optimizer steps per train_step (PPO-style updates within one rollout batch)
        warmup_steps: int = 0  # linear learning-rate warm-up over this many optimizer steps

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.lr <= 0 or self.mini_batches < 1 or self.grad_clip < 0 or self.warmup_steps < 0:
                raise ValueError("lr must be > 0, mini_batches >= 1, grad_clip >= 0, warmup_steps >= 0")

    def __init__(self, ctx: WorkerContext, options: Options):
        super().__init__(ctx, options)
        import torch

        self._add_modules()
        self.params = [p for m in self._trained_modules() for p in m.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=options.lr, weight_decay=options.weight_decay,
                                           betas=options.betas)
        self.optimizer_steps = 0
        self.model.train()

    def _add_modules(self) -> None:
        """Hook for subclasses: modules trained next to the GPT model (the critic's value head)."""

    def _trained_modules(self) -> list[Any]:
        return [self.model]

    def extra_modules(self) -> dict[str, Any]:
        """Trained modules outside the GPT model, by name (saved in the checkpoint's rank files)."""
        return {}

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def save_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Collective: model, optimizer, counters and RNG into ``role_dir`` (see ``checkpoint.trainer_state``)."""
        from rollhpc.checkpoint.trainer_state import save_trainer_state

        return save_trainer_state(self, Path(role_dir))

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def load_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Collective: the state ``save_checkpoint`` wrote, back into this role."""
        from rollhpc.checkpoint.trainer_state import load_trainer_state

        return load_trainer_state(self, Path(role_dir))

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def weights_digest(self) -> str | None:
        """sha256 over the full weights in Hugging Face names and bytes (name order): equal digests mean
        bitwise-equal models whatever the layout. Collective like ``export_weights``."""
        import hashlib

        import torch

        from rollhpc.models.megatron_gpt import export_hf_weights

        if self.ctx.coords.edp_rank != 0:
            return None
        h = hashlib.sha256()
        named = sorted(((n, t.detach().cpu().contiguous()) for n, t in
                        export_hf_weights(self.model, self.vocab_size, self.tp_group)), key=lambda x: x[0])
        for name, t in named:
            h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        for name, module in sorted(self.extra_modules().items()):
            for key, t in sorted(module.state_dict().items()):
                h.update(f"{name}.{key}".encode())
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest() if self.ctx.group_rank == 0 else None

    def _dp_sum(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    @register(Dispatch.DP_SPLIT)
    def train_step(self, batch: Batch, loss_config: LossConfig) -> list[dict[str, float]]:
        """``mini_batches`` optimizer steps on this batch.

        batch: ``tokens [B, L]`` int, ``loss_mask [B, L-1]`` (1 where the target token is a response
        token), ``old_logprob [B, L-1]``, ``advantage [B]`` or ``[B, L-1]``, optional ``ref_logprob``.
        Returns, from each DP leader, one dict of metrics averaged over the mini-batches.
        """
        import torch

        from rollhpc.algo.losses import policy_loss

        o: MegatronTrainWorker.Options = self.options
        t0 = time.perf_counter()
        rows = np.arange(len(batch))
        metrics: dict[str, list[float]] = {}
        for mini in np.array_split(rows, o.mini_batches):
            mask_np = np.asarray(batch["loss_mask"])[mini]
            n_tokens, n_seqs = self._dp_sum([float(mask_np.sum()), float((mask_np.sum(1) > 0).sum())])
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for start in range(0, len(mini), o.micro_batch_size):
                idx = mini[start:start + o.micro_batch_size]
                part = {k: torch.as_tensor(np.asarray(v)[idx], device=self.device) for k, v in batch.data.items()}
                logp, entropy = self._forward(part["tokens"], with_entropy=loss_config.entropy_coef > 0)
                loss, stats = policy_loss(
                    logp, part["old_logprob"].float(), part["advantage"].float(), part["loss_mask"].float(),
                    clip_low=loss_config.clip_low, clip_high=loss_config.clip_high, dual_clip=loss_config.dual_clip,
                    agg=loss_config.agg, ref_logprob=part["ref_logprob"].float() if "ref_logprob" in part else None,
                    kl_coef=loss_config.kl_coef, kl_kind=loss_config.kl_kind, entropy=entropy,
                    entropy_coef=loss_config.entropy_coef, global_tokens=max(n_tokens, 1.0),
                    global_seqs=max(n_seqs, 1.0))
                loss.backward()
                weight = float(part["loss_mask"].sum()) / max(n_tokens, 1.0)  # token share, for averaging stats
                sums["loss"] = sums.get("loss", 0.0) + float(loss)
                for k, v in stats.items():  # loss terms are already shares of the global loss; rates are local
                    share = weight if k.endswith(("_frac", "_mean")) else 1.0
                    sums[k] = sums.get(k, 0.0) + float(v) * share
            self._finish_mini_batch(sums, metrics)
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out.update(n_tokens=float(np.asarray(batch["loss_mask"]).sum()), train_time_s=time.perf_counter() - t0,
                   lr=self.optimizer.param_groups[0]["lr"])
        return [out]

    def _finish_mini_batch(self, sums: dict[str, float], metrics: dict[str, list[float]]) -> None:
        """Sum the metrics over DP ranks, reduce and clip the gradients, take the optimizer step."""
        keys = sorted(sums)
        for k, v in zip(keys, self._dp_sum([sums[k] for k in keys])):
            metrics.setdefault(k, []).append(v)
        self._reduce_gradients()
        metrics.setdefault("grad_norm", []).append(self._clip_gradients(self.options.grad_clip))
        self._set_lr()
        self.optimizer.step()
        self.optimizer_steps += 1

    def _set_lr(self) -> None:
        o = self.options
        scale = min(1.0, (self.optimizer_steps + 1) / o.warmup_steps) if o.warmup_steps else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = o.lr * scale

    def _reduce_gradients(self) -> None:
        """Sum gradients over data-parallel replicas (the loss already divides by global counts)."""
        import torch
        import torch.distributed as dist

        if dist.get_world_size(self.dp_group) == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def _clip_gradients(self, max_norm: float) -> float:
        """Global norm over the full model: TP-sharded parameters summed over the TP group, replicated
        ones (norms, biases of row-parallel layers) counted once."""
        import torch
        import torch.distributed as dist

        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.ctx.layout.tp > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        norm = float((sharded + replicated).sqrt())
        if max_norm > 0 and norm > max_norm:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def export_weights(self, bucket_mb: float = 64.0) -> list[Any] | None:
        """The full weights in Hugging Face names, packed into buckets, from group rank 0.

        Collective inside the first data-parallel replica (its TP ranks all-gather each parameter);
        the other replicas hold the same weights and return at once.
        """
        from rollhpc.models.megatron_gpt import export_hf_weights
        from rollhpc.weight_sync.buckets import pack_buckets

        if self.ctx.coords.edp_rank != 0:  # one replica; with EP its expert shards span several DP ranks
            return None
        named = ((n, t.detach().cpu()) for n, t in export_hf_weights(self.model, self.vocab_size, self.tp_group))
        buckets = list(pack_buckets(named, int(bucket_mb * (1 << 20))))
        return buckets if self.ctx.group_rank == 0 else None


class MegatronCriticWorker(MegatronTrainWorker):
    """PPO's critic: the policy's GPT trunk (initialised from the same checkpoint) with a scalar value
    head on the final-norm hidden states. The language-model head is computed but unused."""

    def _add_modules(self) -> None:
        import torch

        hidden = self.model.config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, device=self.device, dtype=next(self.model.parameters()).dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.ctx.seed)  # same head on every rank (it is replicated over TP and DP)
            torch.nn.init.normal_(self.value_head.weight, std=0.02)
        torch.nn.init.zeros_(self.value_head.bias)
        self._hidden: Any = None
        self.model.decoder.final_layernorm.register_forward_hook(lambda m, i, out: setattr(self, "_hidden", out))

    def _trained_modules(self) -> list[Any]:
        return [self.model, self.value_head]

    def extra_modules(self) -> dict[str, Any]:
        return {"value_head": self.value_head}

    def _values(self, tokens: Any):
        """V(prefix up to t) for t < L-1: ``[b, L-1]``, aligned with the policy's log-prob positions."""
        import torch

        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
        self.model(tokens, positions, None)
        hidden = self._hidden.transpose(0, 1)  # [s, b, h] -> [b, s, h]
        return self.value_head(hidden[:, :-1].float().to(self.value_head.weight.dtype)).squeeze(-1).float()

    @register(Dispatch.DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch:
        import torch

        out = []
        with torch.no_grad():
            for start in range(0, len(batch), self.options.micro_batch_size):
                out.append(self._values(batch["tokens"][start:start + self.options.micro_batch_size]).cpu().numpy())
        return Batch({"values": np.concatenate(out).astype(np.float32)})

    @register(Dispatch.DP_SPLIT)
    def train_step(self, batch: Batch, value_clip: float | None = 0.2) -> list[dict[str, float]]:
        """Clipped value regression on ``returns [B, L-1]`` with ``old_values``, token-mean over ``loss_mask``."""
        import torch

        from rollhpc.algo.losses import aggregate, value_loss

        o = self.options
        t0 = time.perf_counter()
        rows = np.arange(len(batch))
        metrics: dict[str, list[float]] = {}
        for mini in np.array_split(rows, o.mini_batches):
            (n_tokens,) = self._dp_sum([float(np.asarray(batch["loss_mask"])[mini].sum())])
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for start in range(0, len(mini), o.micro_batch_size):
                idx = mini[start:start + o.micro_batch_size]
                part = {k: torch.as_tensor(np.asarray(v)[idx], device=self.device) for k, v in batch.data.items()}
                values = self._values(part["tokens"])
                per_token = value_loss(values, part["old_values"].float(), part["returns"].float(), clip=value_clip)
                loss = aggregate(per_token, part["loss_mask"].float(), "token-mean", global_tokens=max(n_tokens, 1.0))
                loss.backward()
                sums["value_loss"] = sums.get("value_loss", 0.0) + float(loss)
            self._finish_mini_batch(sums, metrics)
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out["train_time_s"] = time.perf_counter() - t0
        return [out]


def _load_safetensors(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
