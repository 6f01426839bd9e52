"""The optimizer section of ``rollhpc ckpt inspect``: per trainer role, what optimizer state a checkpoint holds.

What an engineer resuming at another layout wants before starting the job: which optimizer stack saved the role
(megatron's distributed optimizer, megatron's optimizer without it, or torch's AdamW of older runs), how many
ranks saved it and at which TP/PP/DP, the optimizer step, the format (whether it reshards), and the state itself::

    train: megatron distributed optimizer, saved by 2 ranks (tp 1, pp 2, dp 1), step 1
      format torch_dist, fully_reshardable: gathered on DP rank 0 at save, loads at any TP/PP/DP layout
      state        tensors  elements  dtype      bytes
      main params        9   788,608  float32  3.0 MiB
      ...
      2 shard files, 9.2 MiB on disk; the model: 788,608 parameters, float32

Read from the files alone, in one process without torch.distributed or a model build: the rank files
(``checkpoint.trainer_state``: ``world``, ``optimizer_steps``, the ``megatron_optimizer`` marker: stepped,
distributed; torch AdamW's files, of older runs, have none), the optimizer
dist checkpoint's ``.metadata`` (each tensor's global shape and dtype; megatron saves a weight of every layer as
one stacked tensor, so "tensors" counts checkpoint keys, not per-layer parameters), its ``common.pt`` (the
sharding type, which only the distributed optimizer writes; Adam's own step count) and the model's
``rollhpc_checkpoint.json`` (the TP/PP/EP layout). DP is world / (TP x PP): the trainer roles refuse context
parallelism, so CP is always 1. The rank files and ``common.pt`` load with ``weights_only`` (plain data, tensors,
numpy's RNG arrays): inspecting runs no code from the checkpoint there; the ``.metadata`` files are
torch.distributed.checkpoint's own pickles, read as any load of the checkpoint reads them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollhpc.checkpoint.mcore_files import META_FILE
from rollhpc.checkpoint.role_files import MODEL_DIR, OPTIMIZER_DIR, RANKS_DIR
from rollhpc.checkpoint.storage import human_bytes

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# Read on the login node (``rollhpc ckpt inspect``, ``rollhpc status``): torch loads only when a file is read.

# megatron's optimizer keys: [chained_N.]optimizer.state.<kind>.<parameter key>; chained_N when several
# optimizers are chained (a MoE's dense and expert parameters)
_STATE_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(\w+)\.")
# distributed / non-distributed megatron
_KIND_NAMES = {
    "param": "main params",
    "fp32_param": "main params",
}
_KIND_ORDER = ("main params", "exp_avg", "exp_avg_sq")
_RESHARDS = {
    "fully_reshardable": "gathered on DP rank 0 at save, loads at any TP/PP/DP layout",
    "fully_sharded_model_space": "each parameter sharded like the model, loads at any TP/PP/DP layout",
    "dp_reshardable": "megatron's DP buffers as saved, loads at the same TP/PP (any DP) only",
}


@dataclass
class _Kind:
    """One kind of optimizer state (main params, exp_avg, ...) summed over its tensors."""

    tensors: int = 0
    elements: int = 0
    nbytes: int = 0
    dtypes: tuple[str, ...] = ()


def optimizer_lines(ckpt: Path) -> list[str]:
    """The section for every trainer role of a run checkpoint (a directory holding ``ranks/``); [] if none."""
    roles = [d for d in sorted(Path(ckpt).iterdir()) if (d / RANKS_DIR).is_dir()]
    if not roles:
        return []
    lines = ["optimizer:"]
    for role_dir in roles:
        lines += ["  " + line for line in role_lines(role_dir)]
    return lines


def role_lines(role_dir: Path) -> list[str]:
    """A few lines on one role's optimizer state; problems in reading are said, never raised."""
    rank_files = sorted((role_dir / RANKS_DIR).glob("rank_*.pt"))
    if not rank_files:
        return [f"{role_dir.name}: no rank files in {RANKS_DIR}/"]
    try:
        first = _load_data(rank_files[0])
    except Exception as e:  # noqa: BLE001 -- an unreadable file is reported, not raised
        return [
            f"{role_dir.name}: {rank_files[0].name} is not readable as plain data ({type(e).__name__})"
        ]
    if not isinstance(first, dict):
        return [
            f"{role_dir.name}: {rank_files[0].name} holds a {type(first).__name__}, not a rank's state"
        ]
    world, step = first.get("world", len(rank_files)), first.get("optimizer_steps", "?")
    saved_by = _ranks(role_dir, world)
    marker = first.get("megatron_optimizer")
    if not isinstance(marker, dict):
        lines = [
            f"{role_dir.name}: torch AdamW (optimizer=torch of older runs, removed), saved by {saved_by}, step "
            f"{step}: this rollhpc does not resume it; its {MODEL_DIR}/ converts (rollhpc convert mcore-to-hf)"
        ]
    elif not marker.get("stepped", True):
        lines = [
            f"{role_dir.name}: {_stack(marker.get('distributed'))}, saved by {saved_by}, step {step}: no "
            "optimizer state (saved before the first optimizer step)"
        ]
    else:
        lines = _megatron_lines(role_dir, marker, f"saved by {saved_by}, step {step}", step)
    if len(rank_files) != world:
        lines[0] += f"; ! {RANKS_DIR}/ holds {len(rank_files)} rank file(s)"
    return lines


def _stack(distributed: bool | None) -> str:
    """The stack's name; None where the files do not tell (a megatron checkpoint saved before its first step
    by a rollhpc whose rank files did not record it)."""
    return {
        True: "megatron distributed optimizer",
        False: "megatron optimizer (not distributed)",
    }.get(distributed, "megatron optimizer")


def _megatron_lines(
    role_dir: Path, marker: Mapping[str, object], saved: str, step: object
) -> list[str]:
    """Stack, format, the state by kind and its shard files, for a megatron optimizer that has taken a step."""
    opt_dir = role_dir / OPTIMIZER_DIR
    if not opt_dir.is_dir():
        return [
            f"{role_dir.name}: {_stack(marker.get('distributed'))}, {saved}; ! {OPTIMIZER_DIR}/ is missing"
        ]
    common = _common(opt_dir)
    sharding = sorted(set(_found(common, "param_state_sharding_type")))
    # where the rank files do not say whether it is distributed, only the distributed optimizer's common.pt
    # names a sharding type
    stack = _stack(marker.get("distributed", bool(sharding)))
    adam = {
        int(s)
        for s in _found(common, "step") + _found(common, "common_step")
        if isinstance(s, (int, float))
    }
    # megatron skipped an update (inf gradients under a loss scaler) the run counted
    if adam and adam != {step}:
        saved += f" (Adam's own count: {', '.join(map(str, sorted(adam)))})"
    lines = [f"{role_dir.name}: {stack}, {saved}", "  " + _format(opt_dir, sharding)]
    try:
        kinds, shard_files = _state(opt_dir)
    except Exception as e:  # noqa: BLE001 -- torch.distributed.checkpoint raises several types for a bad file
        return lines + [f"  ! {opt_dir.name}/.metadata unreadable ({type(e).__name__}: {e})"]
    lines += ["  " + line for line in _kind_table(kinds)]
    if "main params" not in kinds:
        lines.append("  no main params: the optimizer updates the model's own fp32 parameters")
    disk = sum(f.stat().st_size for f in shard_files)
    shards = f"{len(shard_files)} shard file{'' if len(shard_files) == 1 else 's'}, {human_bytes(disk)} on disk"
    model = _model_parameters(role_dir)
    lines.append(
        f"  {shards}; the model: {model[0]:,} parameters, {model[1]}" if model else f"  {shards}"
    )
    return lines


def _load_data(path: Path) -> object:
    """torch.load with ``weights_only``: tensors and plain data, plus what numpy's RNG state pickles into (the rank
    files keep ``np.random.get_state()``), so that inspecting a checkpoint runs no code from it."""
    import numpy as np
    import torch

    numpy_rng = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), np._core.multiarray._reconstruct]
    with torch.serialization.safe_globals(numpy_rng):
        return torch.load(path, map_location="cpu", weights_only=True)


def _ranks(role_dir: Path, world: int) -> str:
    """'2 ranks (tp 1, pp 2, dp 1)': the DP size from the model's recorded layout, when it has one."""
    ranks = f"{world} rank{'' if world == 1 else 's'}"
    try:
        layout = json.loads((role_dir / MODEL_DIR / META_FILE).read_text())["layout"]
        tp, pp, ep = int(layout["tp"]), int(layout["pp"]), int(layout.get("ep", 1))
    except (OSError, ValueError, KeyError, TypeError):
        return ranks
    expert = f", ep {ep}" if ep > 1 else ""
    return f"{ranks} (tp {tp}, pp {pp}{expert}, dp {world // (tp * pp)})"


def _common(opt_dir: Path) -> object:
    """megatron's ``common.pt`` (what is not sharded: param groups, sharding type, a step), or {} if unreadable."""
    try:
        return _load_data(opt_dir / "common.pt")
    except Exception:  # noqa: BLE001 -- a missing or odd file leaves the format unknown, said so by _format
        return {}


def _found(obj: object, key: str) -> list[object]:
    """Every value under ``key`` in nested dicts and lists (a chained optimizer nests one dict per optimizer)."""
    out: list[object] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += [v] if k == key and not isinstance(v, (dict, list, tuple)) else _found(v, key)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _found(v, key)
    return [float(v) if hasattr(v, "item") else v for v in out]


def _format(opt_dir: Path, sharding: list[str]) -> str:
    """'format torch_dist, fully_reshardable: ...' from megatron's metadata.json and the sharding type."""
    try:
        backend = json.loads((opt_dir / "metadata.json").read_text())["sharded_backend"]
    except (OSError, ValueError, KeyError, TypeError):
        backend = "unknown (no readable metadata.json)"
    if not sharding:
        return (
            f"format {backend}, sharded like the model (whole on every DP rank, saved once): loads at any "
            "TP/PP/DP layout"
        )
    how = "; ".join(f"{s}: {_RESHARDS.get(s, 'see megatron-core')}" for s in sharding)
    return f"format {backend}, {how}"


def _state(opt_dir: Path) -> tuple[dict[str, _Kind], list[Path]]:
    """Per kind of state, its tensors summed from the dist checkpoint's metadata (global shapes: what every rank
    saved together); and the shard files it names."""
    tensors, shard_names = _tensor_metadata(opt_dir)
    kinds: dict[str, _Kind] = {}
    for key, meta in tensors.items():
        found = _STATE_KEY.match(key)
        name = _KIND_NAMES.get(found.group(1), found.group(1)) if found else "other"
        kind = kinds.setdefault(name, _Kind())
        elements = math.prod(meta.size)
        dtype = meta.properties.dtype
        kind.tensors += 1
        kind.elements += elements
        kind.nbytes += elements * dtype.itemsize
        kind.dtypes = tuple(sorted({*kind.dtypes, str(dtype).removeprefix("torch.")}))
    files = [opt_dir / name for name in shard_names]
    return kinds, [f for f in files if f.is_file()]


def _tensor_metadata(ckpt_dir: Path) -> tuple[dict[str, TensorStorageMetadata], list[str]]:
    """The tensors of a torch.distributed.checkpoint directory by key (global shape, dtype), read from its
    ``.metadata``, and the names of the shard files it names."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    tensors = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    return tensors, sorted({s.relative_path for s in metadata.storage_data.values()})


def _kind_table(kinds: dict[str, _Kind]) -> list[str]:
    order = [k for k in _KIND_ORDER if k in kinds] + sorted(
        k for k in kinds if k not in _KIND_ORDER
    )
    rows = [("state", "tensors", "elements", "dtype", "bytes")]
    rows += [
        (
            k,
            str(kinds[k].tensors),
            f"{kinds[k].elements:,}",
            "/".join(kinds[k].dtypes),
            human_bytes(kinds[k].nbytes),
        )
        for k in order
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if c in (1, 2, 4) else cell.ljust(w)
            for c, (cell, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]


def _model_parameters(role_dir: Path) -> tuple[int, str] | None:
    """(elements, dtypes) of the model dist checkpoint's tensors (padded vocabulary included, a tied embedding
    once): what each kind of optimizer state should cover, and what the fp32 main parameters stand beside."""
    try:
        tensors = list(_tensor_metadata(role_dir / MODEL_DIR)[0].values())
    except Exception:  # noqa: BLE001 -- the model's own problems are the files section's to show
        return None
    dtypes = sorted({str(m.properties.dtype).removeprefix("torch.") for m in tensors})
    return sum(math.prod(m.size) for m in tensors), "/".join(dtypes)
