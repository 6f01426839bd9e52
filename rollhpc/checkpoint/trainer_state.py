"""A megatron trainer role's share of a run checkpoint, written by every rank of the role at once.

Inside the run checkpoint's directory, the role ``train`` (likewise ``critic``) writes (``checkpoint.role_files``
names them)::

    train/model/       the GPT model (a critic's value head included): a megatron dist checkpoint
                       (``checkpoint.mcore``), loadable at any TP/PP/EP layout and convertible to Hugging Face
                       (``rollhpc convert mcore-to-hf``)
    train/optimizer/   megatron's own optimizer checkpoint (fp32 main parameters, Adam moments, step), in one of
                       its two forms (the role's ``optimizer_checkpoint``): ``sharded`` (megatron's
                       ``dp_reshardable``, as Megatron-LM saves by default): each rank writes its own shard of
                       the distributed optimizer's buffers, no gather, no extra memory; loads at another DP size
                       with the same TP/PP/EP. ``reshardable`` (``fully_reshardable``): the state gathered onto
                       each DP group's rank 0 (the whole role's optimizer state in that rank's memory) and saved
                       per parameter; loads at any TP/PP/DP layout, every rank reading the whole state.
                       Absent before the first step
    train/ranks/rank_00003.pt   what each rank holds alone: its RNG states and the optimizer step count

Why dist checkpoints for the optimizer too: a run may resume on a different layout (fewer nodes after
one was excluded, another TP), and a per-rank pickle of the optimizer state would pin the layout. At another
rank count the rank files' RNG states have no counterpart and start fresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rollhpc.checkpoint.mcore import load_mcore_checkpoint, save_mcore_checkpoint, save_strategy
from rollhpc.checkpoint.mcore_files import CheckpointError
from rollhpc.checkpoint.role_files import MODEL_DIR, OPTIMIZER_DIR, RANKS_DIR, rank_file
from rollhpc.checkpoint.run_state import restore_rng_states, save_rng_states
from rollhpc.models.megatron_cpu import import_megatron
from rollhpc.models.megatron_pipeline import chunks_sharded_state_dict
from rollhpc.protocol.worker import WorkerContext

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedStateDict  # noqa: E402
from megatron.core.optimizer import MegatronOptimizer  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

log = logging.getLogger(__name__)

# the role's optimizer_checkpoint -> megatron's distributed optimizer checkpoint format
SHARDING_TYPES = {"sharded": "dp_reshardable", "reshardable": "fully_reshardable"}
# what a dp_reshardable optimizer checkpoint is pinned to
LAYOUT_KEYS = ("tp", "pp", "vpp", "ep", "etp")


class TrainerOptions(Protocol):
    """The options of a trainer role that its checkpoint reads."""

    model_dir: str
    distributed_optimizer: bool
    optimizer_checkpoint: str  # a key of SHARDING_TYPES


class TrainerWorker(Protocol):
    """What a role's checkpoint saves and loads of its worker (``MegatronTrainWorker``, the critic's)."""

    ctx: WorkerContext
    options: TrainerOptions
    chunks: list[torch.nn.Module]
    optimizer: MegatronOptimizer
    optimizer_steps: int


def inner_optimizers(optimizer: MegatronOptimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (one, or one per parameter kind in a ``ChainedOptimizer``: dense and
    expert parameters are sharded over different groups)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield sub.optimizer


def save_trainer_state(worker: TrainerWorker, role_dir: Path) -> dict[str, float | int]:
    """Collective over the role's ranks. The model, then megatron's optimizer checkpoint, then each rank's file
    (RNG, counters). Returns a summary (from every rank; the controller keeps rank 0's)."""
    t0 = time.perf_counter()
    role_dir = Path(role_dir)
    rank = dist.get_rank()
    save_mcore_checkpoint(
        worker.chunks,
        role_dir / MODEL_DIR,
        worker.options.model_dir,
        {"optimizer_steps": worker.optimizer_steps},
    )
    # before the first step megatron's optimizer has no state to save
    stepped = worker.optimizer_steps > 0
    if stepped:
        opt_dir = role_dir / OPTIMIZER_DIR
        if rank == 0:
            opt_dir.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(
            _megatron_optimizer_state(worker, _sharding_type(worker), is_loading=False),
            str(opt_dir),
            sharded_strategy=save_strategy(),
        )
    own = {
        "rank": rank,
        "world": dist.get_world_size(),
        "optimizer_steps": worker.optimizer_steps,
        "megatron_optimizer": {
            "stepped": stepped,
            "distributed": bool(worker.options.distributed_optimizer),
            "sharding_type": _sharding_type(worker),
            "layout": _layout(worker),
        },
        "rng": save_rng_states(),
    }
    path = rank_file(role_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(own, path)
    dist.barrier()  # every rank's files are complete before anyone reports done
    return {"seconds": time.perf_counter() - t0, "optimizer_steps": worker.optimizer_steps}


def load_trainer_state(worker: TrainerWorker, role_dir: Path) -> dict[str, float | int]:
    """Collective: put back what ``save_trainer_state`` wrote (model, optimizer, counters, RNG). The model reshards
    to any layout; the optimizer state to another DP size, or to any layout where saved ``reshardable`` (another
    TP/PP/EP of a ``sharded`` one is refused before anything loads). At another rank count the ranks' RNG states
    start fresh."""
    t0 = time.perf_counter()
    role_dir = Path(role_dir)
    saved_by = _first_rank_state(role_dir)
    sharding = _checked_sharding(role_dir, saved_by["megatron_optimizer"], _layout(worker))
    own = _own_rank_state(role_dir, saved_by)
    load_mcore_checkpoint(worker.chunks, role_dir / MODEL_DIR)
    _load_without_per_parameter_step()
    worker.optimizer.reload_model_params()  # the fp32 main parameters from the model just loaded
    # then the saved ones (the exact fp32 values), moments and step
    if own["megatron_optimizer"]["stepped"]:
        _load_optimizer_state(worker, role_dir / OPTIMIZER_DIR, sharding)
    worker.optimizer_steps = own["optimizer_steps"]
    if own["rng"] is not None:
        restore_rng_states(own["rng"])
    dist.barrier()
    return {"seconds": time.perf_counter() - t0, "optimizer_steps": worker.optimizer_steps}


def _first_rank_state(role_dir: Path) -> dict[str, Any]:
    """Rank 0's file, once it is known to be a megatron trainer's."""
    first = rank_file(role_dir, 0)
    if not first.is_file():
        raise CheckpointError(
            f"{role_dir}: no rank files ({RANKS_DIR}/rank_*.pt): not a trainer checkpoint"
        )
    saved_by = torch.load(first, weights_only=False)
    if "megatron_optimizer" not in saved_by:
        raise CheckpointError(
            f"{role_dir} holds the state of optimizer=torch (AdamW on the weights), which was "
            "removed: resume it with the rollhpc that wrote it, or start from its model "
            f"({role_dir / MODEL_DIR}, e.g. converted with `rollhpc convert mcore-to-hf`)"
        )
    return saved_by


def _checked_sharding(
    role_dir: Path, marker: Mapping[str, Any], layout: Mapping[str, int | None]
) -> str:
    """The optimizer checkpoint's sharding type, after refusing a ``dp_reshardable`` one saved at another
    TP/PP/EP layout (it reshards over DP only)."""
    # rank files without a sharding type were written with fully_reshardable
    sharding = marker.get("sharding_type", "fully_reshardable")
    if (
        marker["stepped"]
        and sharding == "dp_reshardable"
        and marker.get("layout", layout) != layout
    ):
        changed = ", ".join(
            f"{k} {marker['layout'][k]} -> {layout[k]}"
            for k in LAYOUT_KEYS
            if marker["layout"][k] != layout[k]
        )
        raise CheckpointError(
            f"{role_dir}: its optimizer state was saved sharded (optimizer_checkpoint: sharded), "
            f"which reshards over DP only, and this role's layout differs ({changed}): resume "
            "with the saved TP/PP/EP, or save with optimizer_checkpoint: reshardable"
        )
    return sharding


def _own_rank_state(role_dir: Path, saved_by: dict[str, Any]) -> dict[str, Any]:
    """This rank's file; at another rank count rank 0's counters with no RNG states (they start fresh)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if saved_by["world"] == world:
        return saved_by if rank == 0 else torch.load(rank_file(role_dir, rank), weights_only=False)
    log.info(
        "%s: saved by %d ranks, resumed by %d: the optimizer state is resharded, the ranks' RNG states "
        "start fresh",
        role_dir,
        saved_by["world"],
        world,
    )
    return {**saved_by, "rng": None}


def _load_optimizer_state(worker: TrainerWorker, opt_dir: Path, sharding: str) -> None:
    """megatron's optimizer checkpoint into the worker's optimizer, each parameter's Adam step its own."""
    _give_state_to_load_into(worker.optimizer)
    try:
        state = dist_checkpointing.load(
            _megatron_optimizer_state(worker, sharding, is_loading=True), str(opt_dir)
        )
    except Exception as e:  # noqa: BLE001 - megatron raises several types for a bad directory
        raise CheckpointError(
            f"cannot load the optimizer state in {opt_dir}: {type(e).__name__}: {e}"
        ) from e
    # fp32 parameters are their own main parameters: the load copies into the model's leaves
    with torch.no_grad():
        worker.optimizer.load_state_dict(state)
    _restore_steps(worker.optimizer)


def _layout(worker: TrainerWorker) -> dict[str, int | None]:
    """The role's model-parallel layout, which a dp_reshardable optimizer checkpoint is pinned to."""
    return {k: getattr(worker.ctx.layout, k) for k in LAYOUT_KEYS}


def _sharding_type(worker: TrainerWorker) -> str:
    return SHARDING_TYPES[worker.options.optimizer_checkpoint]


def _megatron_optimizer_state(
    worker: TrainerWorker, sharding_type: str, is_loading: bool
) -> ShardedStateDict:
    """megatron's sharded state dict of the optimizer in ``sharding_type``; ``fully_reshardable`` gathers on each
    DP group's rank 0 only (megatron's memory-efficient variant: the default gathers the whole state onto every
    rank, ~12 bytes a parameter on each, more than a 0.5B model at DP 2 on a 24 GiB node has)."""
    metadata = {
        "distrib_optim_sharding_type": sharding_type,
        "distrib_optim_fully_reshardable_mem_efficient": sharding_type == "fully_reshardable",
    }
    return worker.optimizer.sharded_state_dict(
        chunks_sharded_state_dict(worker.chunks), is_loading=is_loading, metadata=metadata
    )


def _give_state_to_load_into(optimizer: MegatronOptimizer) -> None:
    """A new megatron optimizer has no Adam state until its first step, and the distributed optimizer's loading
    state dict reads the step count from it (torch's Adam, without apex or Transformer Engine): take one step of
    zero gradients on the inner optimizers, as megatron does before loading for its FSDP format. The state it
    makes is overwritten by the load, main parameters included."""
    for inner in inner_optimizers(optimizer):
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
    real = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(real, "_rollhpc_step_kept", False):
        return

    def set_states(
        self: DistributedOptimizer,
        model_param: torch.nn.Parameter,
        tensors: dict[str, torch.Tensor],
    ) -> None:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            step = self.optimizer.state[
                self.optimizer.param_groups[group_index]["params"][group_order]
            ].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        real(self, model_param, tensors)

    set_states._rollhpc_step_kept = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _restore_steps(optimizer: MegatronOptimizer) -> None:
    """Give every parameter's Adam state its own ``step``, the count megatron's checkpoint keeps in the param groups.
    megatron's load (torch's Adam, no apex or Transformer Engine) puts one shared ``step`` tensor into every state,
    which torch's Adam then advances once per parameter per step, so that every bias correction would use a count in
    the thousands (a resumed run's next update would differ from the uninterrupted run's by a third of the learning
    rate). And the ``dp_reshardable`` load copies each state's tensors over it again, leaving the step of the
    zero-gradient step taken to have a state to load into (the exact-resume tests hold both)."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    saved = group.get("step")
                    state["step"] = (
                        torch.tensor(float(saved), dtype=state["step"].dtype)
                        if saved is not None
                        else state["step"].clone()
                    )
