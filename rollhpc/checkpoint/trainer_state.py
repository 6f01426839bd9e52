"""A megatron trainer role's share of a run checkpoint, written by every rank of the role at once.

Inside the run checkpoint's directory, the role ``train`` (likewise ``critic``) writes::

    train/model/       the GPT model: a megatron dist checkpoint (``checkpoint.mcore``), loadable at any
                       TP/PP/EP layout and convertible to Hugging Face (``rollhpc convert mcore-to-hf``)
    train/optimizer/   AdamW's moments, a megatron dist checkpoint sharded exactly like the parameters
                       (keys ``optimizer.state.exp_avg.<param key>``), so it reshards with the model
    train/ranks/rank_00003.pt   what each rank holds alone: its RNG states, the optimizer step count and
                       hyper-parameters, modules outside the GPT model (the critic's value head)

Why dist checkpoints for the optimizer too: a run may resume on a different layout (fewer nodes after
one was excluded, another TP), and a per-rank pickle of the moments would pin the layout. AdamW's
per-parameter ``step`` counter (a scalar, which megatron cannot shard like its parameter) is kept in
the rank files.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
RANKS_DIR = "ranks"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _rank_file(role_dir: Path, rank: int) -> Path:
    return role_dir / RANKS_DIR / f"rank_{rank:05d}.pt"


def _sharded_optimizer_state(chunks: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                             state: dict[int, dict[str, torch.Tensor]]
                             ) -> tuple[dict[str, Any], dict[str, tuple[int, str]]]:
    """``state`` (optimizer param index -> {exp_avg, exp_avg_sq}) as megatron ShardedTensors that mirror
    the model's own sharding of each parameter, and structure key -> (param index, moment name)."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            make_sharded_optimizer_tensor)

    from rollhpc.models.megatron_pipeline import chunks_sharded_state_dict

    params = [p for g in optimizer.param_groups for p in g["params"]]
    id_map = get_param_id_to_sharded_param_map(chunks_sharded_state_dict(chunks), params)
    out: dict[str, Any] = {}
    index: dict[str, tuple[int, str]] = {}
    for idx, moments in state.items():
        if idx not in id_map:
            continue  # a parameter outside the GPT model (value head): kept in the rank files
        for key in _MOMENTS:
            sharded = make_sharded_optimizer_tensor(id_map[idx], moments[key], prefix=f"optimizer.state.{key}")
            # the structure's keys are ours; ShardedTensor keys repeat (megatron stacks the layers of a
            # model under one key, each layer at its own offset)
            out[f"{key}/{idx}"] = sharded
            index[f"{key}/{idx}"] = (idx, key)
    return out, index


def _model_param_ids(chunks: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> set[int]:
    in_model = {id(p) for chunk in chunks for p in chunk.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i for i, p in enumerate(params) if id(p) in in_model}


def save_trainer_state(worker: Any, role_dir: Path) -> dict[str, Any]:
    """Collective over the role's ranks. ``worker``: a ``MegatronTrainWorker`` (model chunks, optimizer,
    optimizer_steps, extra modules). Returns a summary (from every rank; the controller keeps rank 0's)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rollhpc.checkpoint.mcore import save_mcore_checkpoint, save_strategy
    from rollhpc.checkpoint.run_state import save_rng_states

    t0 = time.perf_counter()
    role_dir = Path(role_dir)
    rank = dist.get_rank()
    save_mcore_checkpoint(worker.chunks, role_dir / MODEL_DIR, worker.options.model_dir,
                          {"optimizer_steps": worker.optimizer_steps})
    opt_sd = worker.optimizer.state_dict()
    in_model = _model_param_ids(worker.chunks, worker.optimizer)
    moments = {i: s for i, s in opt_sd["state"].items() if i in in_model}
    if moments:  # empty before the first optimizer step
        opt_dir = role_dir / OPTIMIZER_DIR
        if rank == 0:
            opt_dir.mkdir(parents=True)
        dist.barrier()
        sharded, _ = _sharded_optimizer_state(worker.chunks, worker.optimizer, moments)
        dist_checkpointing.save(sharded, str(opt_dir), sharded_strategy=save_strategy())
    steps = {i: float(s["step"]) for i, s in opt_sd["state"].items()}
    outside = {i: s for i, s in opt_sd["state"].items() if i not in in_model}
    own = {
        "rank": rank,
        "world": dist.get_world_size(),
        "optimizer_steps": worker.optimizer_steps,
        "adam_steps": steps,
        "n_params": sum(len(g["params"]) for g in opt_sd["param_groups"]),
        "n_params_with_state": len(opt_sd["state"]),
        "param_groups": opt_sd["param_groups"],
        "outside_model_state": outside,
        "extra_modules": {name: m.state_dict() for name, m in worker.extra_modules().items()},
        "rng": save_rng_states(),
    }
    path = _rank_file(role_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(own, path)
    dist.barrier()  # every rank's files are complete before anyone reports done
    return {"seconds": time.perf_counter() - t0, "optimizer_steps": worker.optimizer_steps}


def load_trainer_state(worker: Any, role_dir: Path) -> dict[str, Any]:
    """Collective: put back what ``save_trainer_state`` wrote (model, optimizer, counters, RNG). The model
    and the optimizer moments load at any layout (another TP or PP split); the rank files need the same
    number of ranks."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rollhpc.checkpoint.mcore import CheckpointError, load_mcore_checkpoint
    from rollhpc.checkpoint.run_state import restore_rng_states

    t0 = time.perf_counter()
    role_dir = Path(role_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = _rank_file(role_dir, rank)
    if not path.is_file():
        saved = sorted((role_dir / RANKS_DIR).glob("rank_*.pt"))
        raise CheckpointError(f"{role_dir}: no state for rank {rank} (the checkpoint holds {len(saved)} rank "
                              f"file(s); this role now has {world} ranks: resume with the layout it was saved with)")
    own = torch.load(path, weights_only=False)
    if own["world"] != world:
        raise CheckpointError(f"{role_dir} was saved by {own['world']} ranks, this role has {world}")
    load_mcore_checkpoint(worker.chunks, role_dir / MODEL_DIR)
    for name, module in worker.extra_modules().items():
        module.load_state_dict(own["extra_modules"][name])
    opt = worker.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    in_model = _model_param_ids(worker.chunks, opt)
    state: dict[int, dict[str, torch.Tensor]] = {}
    same_params = own.get("n_params", len(params)) == len(params)
    if own["n_params_with_state"]:
        adam_steps = own["adam_steps"]
        if not same_params:
            # saved at another pipeline layout: this rank holds other parameters (numbered anew), which
            # took their steps together; their moments come from the dist checkpoint by name
            step = max(adam_steps.values())
            adam_steps = {i: step for i in in_model}
        moments = {i: {k: torch.zeros_like(params[i]) for k in _MOMENTS} for i in in_model if i in adam_steps}
        sharded, index = _sharded_optimizer_state(worker.chunks, opt, moments)
        try:
            loaded = dist_checkpointing.load(sharded, str(role_dir / OPTIMIZER_DIR))
        except Exception as e:  # noqa: BLE001 - megatron raises several types for a bad directory
            raise CheckpointError(f"cannot load the optimizer state in {role_dir / OPTIMIZER_DIR}: "
                                  f"{type(e).__name__}: {e}") from e
        for key, value in loaded.items():
            i, k = index[key]
            state.setdefault(i, {"step": torch.tensor(adam_steps[i], dtype=torch.float32)})[k] = value
        outside = sorted(i for i in range(len(params)) if i not in in_model)  # after the model's, in order
        for i, s in zip(outside, (own["outside_model_state"][k] for k in sorted(own["outside_model_state"]))):
            state[i] = s
    # hyper-parameters as saved; the parameter numbering of this rank's optimizer
    groups = [{**saved, "params": now["params"]}
              for saved, now in zip(own["param_groups"], opt.state_dict()["param_groups"])]
    opt.load_state_dict({"state": state, "param_groups": groups})
    worker.optimizer_steps = own["optimizer_steps"]
    restore_rng_states(own["rng"])
    dist.barrier()
    return {"seconds": time.perf_counter() - t0, "optimizer_steps": worker.optimizer_steps}
