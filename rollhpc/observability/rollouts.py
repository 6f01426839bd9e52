"""RUN_DIR/rollouts/step_NNNNNN.h5: what the policy was asked, what it answered, and how it was scored.

Layout of one file (n samples; ragged sequences stored flat with offsets, so sample i's response is
response_tokens[response_offsets[i]:response_offsets[i + 1]]):

    prompt_tokens     int32   [sum of prompt lengths]
    prompt_offsets    int64   [n + 1]
    response_tokens   int32   [sum of response lengths]
    response_offsets  int64   [n + 1]
    logprobs          float32 [sum of response lengths]   one per response token, offsets as the response
    reward            float32 [n]
    version           int64   [n]                         policy version that generated the sample
    prompt_text       vlen str [n]                        optional
    response_text     vlen str [n]                        optional
    domain            vlen str [n]                        optional: the prompt's domain (multi-domain RLVR)
    components/NAME   float32 [n]                         optional: each reward component (the reward is their
                                                          weighted sum; a sample without NAME has NaN)
    attrs: step (int), time (unix seconds), n (int), format (int)

Each file is written to a temp file in the same directory and renamed into place, so a reader or a
crash never sees a half-written file.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1


@dataclass(kw_only=True)
class RolloutRecord:
    """One step's samples. Ragged fields take a list of 1-D arrays or a 2-D array (equal lengths)."""

    prompt_tokens: Sequence[np.ndarray] | np.ndarray   # n x [prompt_len_i]
    response_tokens: Sequence[np.ndarray] | np.ndarray  # n x [response_len_i]
    logprobs: Sequence[np.ndarray] | np.ndarray         # n x [response_len_i]
    reward: np.ndarray                                  # [n]
    version: np.ndarray                                 # [n]
    prompt_text: Sequence[str] | None = None            # n
    response_text: Sequence[str] | None = None          # n
    domain: Sequence[str] | None = None                 # n
    components: dict[str, np.ndarray] | None = None     # name -> [n]


def _flatten(seqs: Sequence[np.ndarray] | np.ndarray, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets [n + 1]) for a list of 1-D arrays or a 2-D array."""
    if isinstance(seqs, np.ndarray) and seqs.ndim == 2:
        n, width = seqs.shape
        return seqs.astype(dtype).reshape(-1), np.arange(n + 1, dtype=np.int64) * width
    arrays = [np.asarray(s, dtype=dtype).reshape(-1) for s in seqs]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return flat, offsets


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def write_rollouts(path: Path, step: int, record: RolloutRecord) -> Path:
    """Write ``record`` to ``path`` atomically (temp file in the same directory, then os.replace)."""
    import h5py

    path = Path(path)
    prompt, prompt_off = _flatten(record.prompt_tokens, np.int32)
    response, response_off = _flatten(record.response_tokens, np.int32)
    logprobs, logprob_off = _flatten(record.logprobs, np.float32)
    n = len(prompt_off) - 1
    reward = np.asarray(record.reward, dtype=np.float32).reshape(-1)
    version = np.asarray(record.version, dtype=np.int64).reshape(-1)
    if len(response_off) - 1 != n or len(reward) != n or len(version) != n:
        raise ValueError(f"rollout record for step {step}: fields disagree on the number of samples "
                         f"(prompts {n}, responses {len(response_off) - 1}, rewards {len(reward)}, "
                         f"versions {len(version)})")
    if not np.array_equal(logprob_off, response_off):
        raise ValueError(f"rollout record for step {step}: logprobs must have one value per response token")
    texts = {k: v for k, v in (("prompt_text", record.prompt_text), ("response_text", record.response_text),
                               ("domain", record.domain)) if v is not None}
    components = {k: np.asarray(v, dtype=np.float32).reshape(-1) for k, v in (record.components or {}).items()}
    for k, v in components.items():
        if len(v) != n:
            raise ValueError(f"rollout record for step {step}: component {k} has {len(v)} values, expected {n}")
    for k, v in texts.items():
        if len(v) != n:
            raise ValueError(f"rollout record for step {step}: {k} has {len(v)} entries, expected {n}")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"  # same directory, so os.replace is atomic
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(step=int(step), time=time.time(), n=n, format=FORMAT)
            for name, data in (("prompt_tokens", prompt), ("prompt_offsets", prompt_off),
                               ("response_tokens", response), ("response_offsets", response_off),
                               ("logprobs", logprobs), ("reward", reward), ("version", version)):
                f.create_dataset(name, data=data)
            for k, v in texts.items():
                # HDF5 strings end at NUL; a policy may well write NUL bytes, kept visible as U+2400
                f.create_dataset(k, data=[t.replace("\x00", "\u2400") for t in v], dtype=h5py.string_dtype())
            for k, v in components.items():
                f.create_dataset(f"components/{k}", data=v)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_rollouts(path: Path) -> dict[str, Any]:
    """The file as plain Python: ragged fields as lists of numpy arrays, texts as lists of str."""
    import h5py

    with h5py.File(path, "r") as f:
        prompt_off, response_off = f["prompt_offsets"][()], f["response_offsets"][()]
        out: dict[str, Any] = {
            "step": int(f.attrs["step"]),
            "time": float(f.attrs["time"]),
            "prompt_tokens": _split(f["prompt_tokens"][()], prompt_off),
            "response_tokens": _split(f["response_tokens"][()], response_off),
            "logprobs": _split(f["logprobs"][()], response_off),
            "reward": f["reward"][()],
            "version": f["version"][()],
        }
        for k in ("prompt_text", "response_text", "domain"):
            out[k] = [s.decode() for s in f[k][()]] if k in f else None
        out["components"] = {k: f["components"][k][()] for k in f["components"]} if "components" in f else {}
    return out


class RolloutWriter:
    """Writes RUN_DIR/rollouts/step_{step:06d}.h5, one file per logged step."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.directory / f"step_{step:06d}.h5"

    def write(self, step: int, record: RolloutRecord) -> Path:
        return write_rollouts(self.path(step), step, record)
