"""Megatron-core distributed checkpoints of a ``GPTModel`` built by ``rollhpc.models.megatron_gpt``.

A checkpoint directory is megatron's ``torch_dist`` format (``metadata.json``, ``common.pt``,
``.metadata``, ``__R_T.distcp`` data files) plus our metadata file and ``hf/`` folder
(``checkpoint.mcore_files``, which reads them without torch).

The tensors are global (megatron stores each as its full shape, cut into chunks as the saving ranks
held them), so a checkpoint saved at one TP/PP/EP layout loads at any other: megatron reads the chunks
each rank needs. Vocab padding differs per TP size; megatron pads or trims the embedding rows on load.

* ``save_mcore_checkpoint`` / ``load_mcore_checkpoint``: collective, from inside a running trainer
  (every rank, torch.distributed and megatron's parallel state initialised). The save is atomic: the
  ranks write a temporary directory beside the target, rank 0 renames it into place after a barrier.
* ``McoreReader``: one process (a world of size 1), reads one parameter at a time, in the names of a
  TP=1/PP=1/EP=1 model, without building the model's weights (a skeleton on the meta device gives
  megatron's checkpoint keys and shapes). The converter streams megatron -> HF through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollhpc.checkpoint.mcore_files import (
    FORMAT,
    FORMAT_VERSION,
    HF_EXTRAS_DIR,
    META_FILE,
    CheckpointError,
    copy_hf_extras,
    file_manifest,
    read_metadata,
)
from rollhpc.models import megatron_cpu
from rollhpc.models.hf_weight_map import HfConfigSource, _hf_dict
from rollhpc.models.lora import attach_lora
from rollhpc.models.lora_config import LoraConfig
from rollhpc.models.megatron_gpt import build_gpt_model
from rollhpc.models.megatron_pipeline import chunks_sharded_state_dict, load_chunks_state
from rollhpc.proc.parent_death import die_with_parent
from rollhpc.rundir import replace_dir

megatron_cpu.import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: E402
    TorchDistSaveShardedStrategy,
)
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402

Model = (
    torch.nn.Module | Sequence[torch.nn.Module]
)  # a GPTModel, or a rank's virtual pipeline chunks


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def parallel_layout() -> dict[str, int]:
    """tp/pp/ep/etp/world of the initialised megatron parallel state."""
    return dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        world=dist.get_world_size(),
    )


_write_results_manager = None


def _write_results_queue_that_dies_with_us() -> None:
    """megatron's file writer passes its results through a queue served by a multiprocessing Manager: a
    spawned server process (~300 MB: it imports what the rank imported) that outlives a SIGKILLed rank,
    e.g. an OOM kill or a killed local run. Start that Manager here, with a parent-death signal, and hand
    megatron its queue before it makes its own. Call from the thread that lives as long as the rank (the
    signal follows the creating thread)."""
    global _write_results_manager
    if (
        _write_results_manager is not None
        or getattr(filesystem_async, "_results_queue", None) is not None
    ):
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _write_results_manager = manager


def save_strategy() -> TorchDistSaveShardedStrategy:
    """megatron's torch_dist save strategy, one data file per rank (thread_count=1: a rank's shard is
    one file, so "largest shard" is the largest file)."""
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def save_mcore_checkpoint(
    model: Model,
    out_dir: str | Path,
    hf_config: HfConfigSource,
    layout_info: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
    checksums: bool = False,
    sharded_state_dict: ShardedStateDict | None = None,
) -> Path:
    """Save ``model`` (a megatron ``GPTModel`` from ``build_gpt_model``, or a rank's list of virtual
    pipeline chunks) as a dist checkpoint in ``out_dir``. Collective: every rank calls it. ``hf_config``: the HF
    config the model was built from (dict, transformers config, config.json path, or the HF model directory:
    then its tokenizer and other files go to ``hf/`` too). ``layout_info``: recorded in the metadata over the
    parallel state's tp/pp/ep/etp/world (e.g. ``{"step": 100}``). An existing ``out_dir`` is an error unless
    ``overwrite`` (replaced only once the new checkpoint is complete). ``checksums``: sha256 of every
    file in the manifest (rank 0 reads the whole checkpoint back once). ``sharded_state_dict``: what to
    write, when not ``model.sharded_state_dict()`` (the converter passes one that needs no copies)."""
    out_dir = Path(out_dir).absolute()
    rank = dist.get_rank()
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    # every rank sees the same (shared) filesystem: all raise
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    chunks = _as_chunks(model)
    if sharded_state_dict is None:
        sharded_state_dict = chunks_sharded_state_dict(chunks)
    _write_results_queue_that_dies_with_us()
    dist_checkpointing.save(sharded_state_dict, str(tmp), sharded_strategy=save_strategy())
    dist.barrier()  # every rank's files are written (dist_checkpointing.save ends with one too)
    if rank == 0:
        _write_metadata(tmp, chunks[0], hf_config, layout_info, checksums)
        replace_dir(tmp, out_dir)
    dist.barrier()
    return out_dir


def _write_metadata(
    tmp: Path,
    first_chunk: torch.nn.Module,
    hf_config: HfConfigSource,
    layout_info: Mapping[str, Any] | None,
    checksums: bool,
) -> None:
    """Rank 0's part of a save: ``META_FILE`` over the files written, and the HF directory's other files."""
    meta: dict[str, Any] = dict(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        hf_config=_hf_dict(hf_config),
        layout={**parallel_layout(), **dict(layout_info or {})},
        padded_vocab_size=int(first_chunk.vocab_size),
        params_dtype=_dtype_name(next(first_chunk.parameters()).dtype),
        files=file_manifest(tmp, checksums),
    )
    if isinstance(hf_config, (str, Path)) and Path(hf_config).is_dir():
        meta["hf_files"] = copy_hf_extras(Path(hf_config), tmp / HF_EXTRAS_DIR)
    # rollhpc.models.lora: adapters saved beside the base
    lora = getattr(first_chunk, "lora_config", None)
    if lora is not None:
        meta["lora"] = dataclasses.asdict(lora)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def _as_chunks(model: Model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def load_mcore_checkpoint(
    model: Model, ckpt_dir: str | Path, *, checksums: bool = False
) -> dict[str, Any]:
    """Load a checkpoint saved by ``save_mcore_checkpoint`` (or the converter) into ``model`` (or a
    rank's list of virtual pipeline chunks), whatever TP/PP/VPP/EP layout it was saved with. Collective: every
    rank calls it. Returns the checkpoint's metadata. Raises ``CheckpointError`` for a missing/corrupt
    checkpoint or one of another model."""
    chunks = _as_chunks(model)
    meta = read_metadata(ckpt_dir, checksums=checksums)
    _check_model_matches(chunks[0], meta)
    try:
        state = dist_checkpointing.load(chunks_sharded_state_dict(chunks), str(ckpt_dir))
        load_chunks_state(chunks, state)
    except (CheckpointingException, KeyError, RuntimeError, ValueError, OSError, EOFError) as e:
        raise CheckpointError(
            f"cannot load {ckpt_dir} into the model: {type(e).__name__}: {e}"
        ) from e
    return meta


def _check_model_matches(model: torch.nn.Module, meta: Mapping[str, Any]) -> None:
    cfg, c = meta["hf_config"], model.config
    pairs = [
        ("num_hidden_layers", cfg.get("num_hidden_layers"), c.num_layers),
        ("hidden_size", cfg.get("hidden_size"), c.hidden_size),
        ("num_attention_heads", cfg.get("num_attention_heads"), c.num_attention_heads),
        (
            "num_experts",
            cfg.get("num_experts") or cfg.get("num_local_experts") or None,
            c.num_moe_experts,
        ),
    ]
    wrong = [f"{name}: checkpoint {a}, model {b}" for name, a, b in pairs if a != b]
    if wrong:
        raise CheckpointError(f"the checkpoint is of another model ({'; '.join(wrong)})")


@contextlib.contextmanager
def single_process_world(backend: str = "gloo") -> Iterator[None]:
    """torch.distributed (gloo, an in-process store) and megatron's parallel state for a world of one
    process: what megatron's dist_checkpointing needs to read a checkpoint offline (``backend="nccl"``: where
    megatron's DDP runs collectives on GPU tensors)."""
    if dist.is_initialized():
        raise RuntimeError(
            "single_process_world: torch.distributed is already initialised in this process"
        )
    megatron_cpu.enable_cpu_megatron()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _plain(piece: ShardedTensor) -> ShardedTensor:
    """A ShardedTensor requesting the same chunk as ``piece`` with its prepended axes (layer, expert)
    spelled out as size-1 dimensions and no fixed grid: megatron then loads it through DCP's plain chunk
    reading, so one layer of a layer-stacked tensor can be read alone."""
    shape = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
    return ShardedTensor(
        key=piece.key,
        data=torch.empty(shape, dtype=piece.dtype),
        dtype=piece.dtype,
        local_shape=shape,
        global_shape=tuple(piece.global_shape),
        global_offset=tuple(piece.global_offset),
        axis_fragmentations=None,
        replica_id=0,
        prepend_axis_num=0,
        allow_shape_mismatch=piece.allow_shape_mismatch,
    )


class McoreReader:
    """Reads a checkpoint's parameters one at a time, in the names of the TP=1/PP=1/EP=1 model (the full
    tensors), in a ``single_process_world``. Construction checks the files (``read_metadata``) and that
    the checkpoint holds every tensor the config implies, with the right global shape."""

    def __init__(self, ckpt_dir: str | Path, *, checksums: bool = True):
        self.ckpt_dir = Path(ckpt_dir)
        self.meta = read_metadata(self.ckpt_dir, checksums=checksums)
        self.hf_config = self.meta["hf_config"]
        self.dtype = dtype_from_name(self.meta["params_dtype"])
        stored = self._tensor_index()
        emb = stored.get("embedding.word_embeddings.weight")
        padded = tuple(emb.global_shape)[0] if emb is not None else self.meta["padded_vocab_size"]
        with torch.device("meta"):
            self.skeleton = build_gpt_model(
                self.hf_config,
                tp=1,
                params_dtype=self.dtype,
                padded_vocab=padded,
                perform_initialization=False,
            )
        # a LoRA checkpoint's adapters (rollhpc.models.lora): read like any parameter
        self.lora: LoraConfig | None = None
        if self.meta.get("lora"):
            self.lora = LoraConfig(**self.meta["lora"])
            attach_lora(self.skeleton, self.lora, 0, 1, None)
        self.sharded = {
            k: v
            for k, v in self.skeleton.sharded_state_dict().items()
            if not isinstance(v, ShardedObject)
        }
        self._check_stored(stored)

    def _tensor_index(self) -> dict[str, ShardedTensor | ShardedObject]:
        """The checkpoint's tensors by key (global shapes), from its ``.metadata``."""
        try:
            return dist_checkpointing.load_tensors_metadata(str(self.ckpt_dir))
        except Exception as e:  # noqa: BLE001 - megatron/torch raise many kinds for a damaged .metadata
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir} is incomplete or corrupt: cannot read its tensor "
                f"index ({type(e).__name__}: {e})"
            ) from e

    def _check_stored(self, stored: Mapping[str, ShardedTensor | ShardedObject]) -> None:
        """Every tensor the skeleton has is in ``stored`` with the same global shape."""
        missing, wrong = [], []
        for sh in self.sharded.values():
            for piece in _pieces(sh):
                if piece.key not in stored:
                    missing.append(piece.key)
                elif tuple(stored[piece.key].global_shape) != tuple(piece.global_shape):
                    wrong.append(
                        f"{piece.key}: checkpoint {tuple(stored[piece.key].global_shape)}, "
                        f"config implies {tuple(piece.global_shape)}"
                    )
        if missing:
            missing = sorted(set(missing))
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir} lacks {len(missing)} tensor(s) its config.json implies: "
                f"{missing[:6]}{' ...' if len(missing) > 6 else ''}"
            )
        if wrong:
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir} does not match its config.json (shape mismatch): "
                f"{'; '.join(sorted(set(wrong))[:6])}"
            )

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full (TP=1) tensors of megatron parameters ``names``."""
        unknown = [n for n in names if n not in self.sharded]
        if unknown:
            raise KeyError(f"not parameters of this model: {unknown}")
        request = {
            f"{n}#{i}": _plain(p) for n in names for i, p in enumerate(_pieces(self.sharded[n]))
        }
        try:
            state = dist_checkpointing.load(
                request, str(self.ckpt_dir), validate_access_integrity=False
            )
        except Exception as e:  # noqa: BLE001 - any failure to read the data files is a damaged checkpoint
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir} is incomplete or corrupt: reading {names} failed "
                f"({type(e).__name__}: {e})"
            ) from e
        out = {}
        for n in names:
            sh = self.sharded[n]
            loaded = [state[f"{n}#{i}"].reshape(p.local_shape) for i, p in enumerate(_pieces(sh))]
            out[n] = (
                sh.merge_fn(_like(sh.build(), loaded))
                if isinstance(sh, ShardedTensorFactory)
                else loaded[0]
            )
        return out


def _like(
    built: ShardedTensor | list[ShardedTensor] | dict[str, ShardedTensor],
    tensors: list[torch.Tensor],
) -> torch.Tensor | list[torch.Tensor] | dict[str, torch.Tensor]:
    """``tensors`` (in ``_pieces`` order) in the container shape a factory's ``build()`` returned."""
    if isinstance(built, dict):
        return dict(zip(built, tensors))
    if isinstance(built, list):
        return list(tensors)
    return tensors[0]


def _pieces(sharded: ShardedTensor | ShardedTensorFactory) -> list[ShardedTensor]:
    """The ShardedTensors a (meta) ShardedTensor or ShardedTensorFactory stands for."""
    if isinstance(sharded, ShardedTensorFactory):
        built = sharded.build()
        return (
            list(built.values())
            if isinstance(built, dict)
            else list(built)
            if isinstance(built, list)
            else [built]
        )
    return [sharded]
