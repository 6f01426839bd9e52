"""What a conversion's worker process runs: the job's body (``to_mcore``, ``to_hf`` or ``verify``) for one
rank, its result written as ``result-RANK.json`` and a failure as ``error-RANK.json`` in the job's folder,
where the calling process (``convert.run_workers``) reads them."""

from __future__ import annotations

import ctypes
import json
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from rollhpc.checkpoint.mcore_files import CheckpointError
from rollhpc.checkpoint.safetensors_io import SafetensorsError
from rollhpc.conversion import to_hf, to_mcore
from rollhpc.conversion.checks import ConversionError
from rollhpc.rundir import atomic_write_json

Body = Callable[[int, Mapping[str, Any]], dict[str, Any]]

# failures whose message says it all: no traceback in the report
_CLEAR_ERRORS = (
    ConversionError,
    CheckpointError,
    SafetensorsError,
    KeyError,
    ValueError,
    NotImplementedError,
    FileExistsError,
    FileNotFoundError,
)


def run(rank: int, job: Mapping[str, Any], out: str) -> None:
    """Rank ``rank``'s part of ``job``; its result (or its failure, then re-raised) into the folder ``out``."""
    # megatron's "Transformer Engine / apex not installed" and the like
    warnings.simplefilter("ignore")
    torch.set_num_threads(job["threads"])
    _fixed_mmap_threshold()
    try:
        result = _body(job["kind"])(rank, job)
    except BaseException as e:
        message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        clear = isinstance(e, _CLEAR_ERRORS)
        if not clear:  # unexpected: keep the traceback
            message = f"{type(e).__name__}: {message}\n{traceback.format_exc()}"
        Path(out, f"error-{rank}.json").write_text(json.dumps({"message": message, "clear": clear}))
        raise
    atomic_write_json(Path(out, f"result-{rank}.json"), result)


def _body(kind: str) -> Body:
    if kind == "verify":
        # transformers loads only in the worker that compares logits, not in every conversion worker
        from rollhpc.conversion import verify

        return verify.verify_rank
    return {"hf_to_mcore": to_mcore.convert_rank, "mcore_to_hf": to_hf.convert_rank}[kind]


def _fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """glibc: serve every allocation above ``nbytes`` by mmap, returned to the system when freed. By
    default the threshold grows with the blocks freed, so the tensors read one after the other end up
    on the heap, which does not shrink: the resident set would keep the largest ones long after."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
