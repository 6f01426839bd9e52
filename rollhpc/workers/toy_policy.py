"""The toy demo's roles around a tiny torch policy: trainer (data-parallel over MPI) and generator (the
rule-based reward is workers/modsum_reward.py, without torch). Same contracts as the Megatron/vLLM roles,
a model small enough for 2 CPU cores. Their options and remote methods are their specs' (toy_policy_spec).
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from rollhpc.algo.losses import clipped_pg_loss
from rollhpc.batch import Batch
from rollhpc.protocol.worker import Worker, WorkerContext
from rollhpc.workers.toy_policy_spec import (
    PolicyOptions,
    ToyGenerateWorkerSpec,
    ToyTrainWorkerSpec,
)


def build_policy(modulus: int, hidden: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(2 * modulus, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, modulus)
    )


def _features(prompts: np.ndarray, modulus: int) -> torch.Tensor:
    p = torch.as_tensor(prompts)
    return torch.cat(
        [
            torch.nn.functional.one_hot(p[:, 0], modulus),
            torch.nn.functional.one_hot(p[:, 1], modulus),
        ],
        dim=1,
    ).float()


class ToyTrainWorker(ToyTrainWorkerSpec, Worker):
    def __init__(self, ctx: WorkerContext, options: ToyTrainWorkerSpec.Options):
        super().__init__(ctx, options)
        torch.set_num_threads(1)
        # same seed: replicas start equal
        self.model = build_policy(options.modulus, options.hidden, ctx.seed)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=options.lr)

    def train_step(self, batch: Batch) -> list[dict[str, float]]:
        o = self.options
        logits = self.model(_features(batch["prompt"], o.modulus))
        logp = (
            torch.log_softmax(logits, -1)
            .gather(1, torch.as_tensor(batch["answer"])[:, None])
            .squeeze(1)
        )
        per_sample = clipped_pg_loss(
            logp,
            torch.as_tensor(batch["logprob"]),
            torch.as_tensor(batch["advantage"]),
            o.clip,
            o.clip,
        )
        # sum here, divide by the global batch after the all-reduce: equal to one big batch's mean
        n_global = self.ctx.role_comm.allreduce(len(batch), op=MPI.SUM)
        loss = per_sample.sum() / n_global
        self.optim.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        self.ctx.role_comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
        offset = 0
        for p in self.model.parameters():
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.optim.step()
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
        return [
            {
                "loss": float(loss) * n_global / max(len(batch), 1),
                "entropy": float(entropy),
                "n": len(batch),
            }
        ]

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class ToyGenerateWorker(ToyGenerateWorkerSpec, Worker):
    def __init__(self, ctx: WorkerContext, options: PolicyOptions):
        super().__init__(ctx, options)
        torch.set_num_threads(1)
        self.model = build_policy(options.modulus, options.hidden, ctx.seed)
        self.version = 0
        self.gen = torch.Generator().manual_seed(ctx.seed * 1000 + ctx.group_rank)

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        self.model.load_state_dict(state)
        self.version = version
        return version

    def generate(self, prompts: np.ndarray | list, samples_per_prompt: int) -> Batch:
        p = np.repeat(
            np.asarray(prompts, dtype=np.int64).reshape(-1, 2), samples_per_prompt, axis=0
        )
        with torch.no_grad():
            logp = torch.log_softmax(self.model(_features(p, self.options.modulus)), -1)
            answer = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(1)
        return Batch(
            {
                "prompt": p,
                "answer": answer.numpy(),
                "logprob": logp.gather(1, answer[:, None]).squeeze(1).numpy(),
                "version": np.full(len(p), self.version, dtype=np.int64),
            }
        )

    def greedy(self, prompts: list) -> list[int]:
        with torch.no_grad():
            return (
                self.model(
                    _features(
                        np.asarray(prompts, dtype=np.int64).reshape(-1, 2), self.options.modulus
                    )
                )
                .argmax(-1)
                .tolist()
            )
