"""A megatron trainer role's share of a run checkpoint, written by every rank of the role at once.

Inside the run checkpoint's directory, the role ``train`` (likewise ``critic``) writes::

    train/model/       the GPT model: a megatron dist checkpoint (``checkpoint.mcore``), loadable at any
                       TP/PP/EP layout and convertible to Hugging Face (``rollhpc convert mcore-to-hf``)
    train/optimizer/   AdamW's moments, a megatron dist checkpoint sharded exactly like the parameters
                       (keys ``optimizer.state.exp_avg.<param key>``), so it reshards with the model; with
                       ``optimizer: megatron``, megatron's own optimizer checkpoint (fp32 main parameters,
                       moments, step; its ``fully_reshardable`` form: gathered over the DP group at save,
                       each rank reading what it needs at load, so it loads at another DP, TP or PP layout)
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
    if getattr(worker, "megatron_optimizer", False):
        return _save_megatron_optimizer(worker, role_dir, t0)
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
    number of ranks, except with ``optimizer: megatron``, whose checkpoint also reshards over the DP size (the
    ranks' RNG states then start fresh)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rollhpc.checkpoint.mcore import CheckpointError, load_mcore_checkpoint
    from rollhpc.checkpoint.run_state import restore_rng_states

    t0 = time.perf_counter()
    role_dir = Path(role_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = _rank_file(role_dir, rank)
    first = _rank_file(role_dir, 0)
    saved_by = torch.load(first, weights_only=False) if first.is_file() else None
    if saved_by is not None and "megatron_optimizer" in saved_by and saved_by["world"] != world:
        # megatron's optimizer checkpoint reshards to any layout, DP size included; what the rank files hold alone
        # (RNG states) has no counterpart at another rank count, and starts fresh
        log.info("%s: saved by %d ranks, resumed by %d: the optimizer state is resharded, the ranks' RNG states "
                 "start fresh", role_dir, saved_by["world"], world)
        if not getattr(worker, "megatron_optimizer", False):
            raise CheckpointError(f"{role_dir} holds the optimizer state of optimizer=megatron; this role uses torch")
        load_mcore_checkpoint(worker.chunks, role_dir / MODEL_DIR)
        return _load_megatron_optimizer(worker, role_dir, {**saved_by, "rng": None}, t0)
    if not path.is_file():
        saved = sorted((role_dir / RANKS_DIR).glob("rank_*.pt"))
        raise CheckpointError(f"{role_dir}: no state for rank {rank} (the checkpoint holds {len(saved)} rank "
                              f"file(s); this role now has {world} ranks: resume with the layout it was saved with)")
    own = saved_by if rank == 0 else torch.load(path, weights_only=False)
    if own["world"] != world:
        raise CheckpointError(f"{role_dir} was saved by {own['world']} ranks, this role has {world}")
    load_mcore_checkpoint(worker.chunks, role_dir / MODEL_DIR)
    if getattr(worker, "megatron_optimizer", False) != ("megatron_optimizer" in own):
        raise CheckpointError(f"{role_dir} holds the optimizer state of optimizer="
                              f"{'megatron' if 'megatron_optimizer' in own else 'torch'}; this role uses the other one")
    if "megatron_optimizer" in own:
        return _load_megatron_optimizer(worker, role_dir, own, t0)
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


# -- optimizer: megatron ------------------------------------------------------------------------------------------
_MEGATRON_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _megatron_optimizer_state(worker: Any, is_loading: bool) -> dict[str, Any]:
    from rollhpc.models.megatron_pipeline import chunks_sharded_state_dict

    return worker.optimizer.sharded_state_dict(chunks_sharded_state_dict(worker.chunks), is_loading=is_loading,
                                               metadata=_MEGATRON_FORMAT)


def _save_megatron_optimizer(worker: Any, role_dir: Path, t0: float) -> dict[str, Any]:
    """megatron's optimizer checkpoint (with the model already saved) and the rank files (RNG, counters)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rollhpc.checkpoint.mcore import save_strategy
    from rollhpc.checkpoint.run_state import save_rng_states

    rank = dist.get_rank()
    stepped = worker.optimizer_steps > 0  # before the first step megatron's optimizer has no state to save
    if stepped:
        opt_dir = role_dir / OPTIMIZER_DIR
        if rank == 0:
            opt_dir.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(_megatron_optimizer_state(worker, is_loading=False), str(opt_dir),
                                sharded_strategy=save_strategy())
    own = {"rank": rank, "world": dist.get_world_size(), "optimizer_steps": worker.optimizer_steps,
           "megatron_optimizer": {"stepped": stepped}, "rng": save_rng_states()}
    path = _rank_file(role_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(own, path)
    dist.barrier()
    return {"seconds": time.perf_counter() - t0, "optimizer_steps": worker.optimizer_steps}


def _load_megatron_optimizer(worker: Any, role_dir: Path, own: dict[str, Any], t0: float) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rollhpc.checkpoint.mcore import CheckpointError
    from rollhpc.checkpoint.run_state import restore_rng_states

    _load_without_per_parameter_step()
    worker.optimizer.reload_model_params()  # the fp32 main parameters from the model just loaded
    if own["megatron_optimizer"]["stepped"]:  # then the saved ones (the exact fp32 values), moments and step
        _give_state_to_load_into(worker.optimizer)
        try:
            state = dist_checkpointing.load(_megatron_optimizer_state(worker, is_loading=True),
                                            str(role_dir / OPTIMIZER_DIR))
        except Exception as e:  # noqa: BLE001 - megatron raises several types for a bad directory
            raise CheckpointError(f"cannot load the optimizer state in {role_dir / OPTIMIZER_DIR}: "
                                  f"{type(e).__name__}: {e}") from e
        worker.optimizer.load_state_dict(state)
        _unshare_steps(worker.optimizer)
    worker.optimizer_steps = own["optimizer_steps"]
    if own["rng"] is not None:
        restore_rng_states(own["rng"])
    dist.barrier()
    return {"seconds": time.perf_counter() - t0, "optimizer_steps": worker.optimizer_steps}


def _give_state_to_load_into(optimizer: Any) -> None:
    """A new megatron optimizer has no Adam state until its first step, and the distributed optimizer's loading
    state dict reads the step count from it (torch's Adam, without apex or Transformer Engine): take one step of
    zero gradients on the inner optimizers, as megatron does before loading for its FSDP format. The state it
    makes is overwritten by the load, main parameters included."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        if inner.state:
            continue
        params = [p for group in inner.param_groups for p in group["params"] if p.numel()]
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)


def _load_without_per_parameter_step() -> None:
    """megatron-core 0.16.1's distributed optimizer with torch's Adam (no apex, no Transformer Engine) cannot load
    its own reshardable checkpoint: ``load_state_dict`` gives every parameter's Adam state a ``step`` (from the
    param groups, where the checkpoint keeps it), then ``_set_main_param_and_optimizer_states`` copies the loaded
    tensors over every key of that state, ``step`` included, which the checkpoint's per-parameter tensors (main
    parameter and moments) do not have: KeyError 'step'. Here the step the state already holds is copied onto
    itself. Patched once per process; nothing changes where the loaded tensors carry a step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(real, "_rollhpc_step_kept", False):
        return

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            step = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        real(self, model_param, tensors)

    set_states._rollhpc_step_kept = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _unshare_steps(optimizer: Any) -> None:
    """megatron's load (torch's Adam, no apex or Transformer Engine) puts one ``step`` tensor into every parameter's
    Adam state; torch's Adam then adds 1 to it once per parameter per step, and from the next step on every bias
    correction uses a step count in the thousands (found by a resumed run whose next update differed from the
    uninterrupted run's by a third of the learning rate). Each state gets its own copy."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in sub.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
