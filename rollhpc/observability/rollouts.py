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
    routes            int16   [sum of fed lengths, L, k]  optional (MoE, routing replay): the experts each token the
                                                          generator fed was routed to in each of its L MoE layers
    route_offsets     int64   [n + 1]                     sample i's fed tokens: prompt + response minus its last
  multi-turn episodes (agentic runs), all optional:
    response_mask     int8    [sum of response lengths]   1 on generated tokens, 0 on observation tokens
    turn_ends         int32   [sum of turns]              index in the response of each turn's last generated token
    turn_rewards      float32 [sum of turns]              the environment's reward for each turn
    turn_offsets      int64   [n + 1]                     sample i's turns are [turn_offsets[i], turn_offsets[i+1])
    finish            vlen str [n]                        how the episode ended (terminated, truncated, a reason)
    success           int8    [n]                         whether the episode solved its task
    attrs: step (int), time (unix seconds), n (int), format (int)

Each file is written to a temp file in the same directory and renamed into place, so a reader or a
crash never sees a half-written file.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt

from rollhpc.rundir import atomic_file

FORMAT = 1


@dataclass(kw_only=True)
class RolloutRecord:
    """One step's samples. Ragged fields take a list of 1-D arrays or a 2-D array (equal lengths)."""

    prompt_tokens: Sequence[np.ndarray] | np.ndarray  # n x [prompt_len_i]
    response_tokens: Sequence[np.ndarray] | np.ndarray  # n x [response_len_i]
    logprobs: Sequence[np.ndarray] | np.ndarray  # n x [response_len_i]
    reward: np.ndarray  # [n]
    version: np.ndarray  # [n]
    prompt_text: Sequence[str] | None = None  # n
    response_text: Sequence[str] | None = None  # n
    domain: Sequence[str] | None = None  # n
    components: dict[str, np.ndarray] | None = None  # name -> [n]
    # n x [response_len_i]: 1 generated, 0 observation
    response_mask: Sequence[np.ndarray] | None = None
    turn_ends: Sequence[np.ndarray] | None = None  # n x [turns_i]
    turn_rewards: Sequence[np.ndarray] | None = None  # n x [turns_i]
    finish: Sequence[str] | None = None  # n
    success: np.ndarray | None = None  # [n]
    # n x [fed_i, moe_layers, top_k] int16: the generator's routes (Sample.routes)
    routes: Sequence[np.ndarray] | None = None


def _flatten(
    seqs: Sequence[np.ndarray] | np.ndarray, dtype: npt.DTypeLike
) -> tuple[np.ndarray, np.ndarray]:
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
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def _per_sample_arrays(step: int, record: RolloutRecord) -> dict[str, np.ndarray]:
    """The fields every sample has, flattened with their offsets, checked to agree on the sample count."""
    prompt, prompt_off = _flatten(record.prompt_tokens, np.int32)
    response, response_off = _flatten(record.response_tokens, np.int32)
    logprobs, logprob_off = _flatten(record.logprobs, np.float32)
    n = len(prompt_off) - 1
    reward = np.asarray(record.reward, dtype=np.float32).reshape(-1)
    version = np.asarray(record.version, dtype=np.int64).reshape(-1)
    if len(response_off) - 1 != n or len(reward) != n or len(version) != n:
        raise ValueError(
            f"rollout record for step {step}: fields disagree on the number of samples "
            f"(prompts {n}, responses {len(response_off) - 1}, rewards {len(reward)}, "
            f"versions {len(version)})"
        )
    if not np.array_equal(logprob_off, response_off):
        raise ValueError(
            f"rollout record for step {step}: logprobs must have one value per response token"
        )
    return {
        "prompt_tokens": prompt,
        "prompt_offsets": prompt_off,
        "response_tokens": response,
        "response_offsets": response_off,
        "logprobs": logprobs,
        "reward": reward,
        "version": version,
    }


def _optional_fields(
    step: int, record: RolloutRecord, n: int
) -> tuple[dict[str, Sequence[str]], dict[str, np.ndarray]]:
    """(the texts given, the reward components given), each checked to hold one entry per sample."""
    texts = {
        k: v
        for k, v in (
            ("prompt_text", record.prompt_text),
            ("response_text", record.response_text),
            ("domain", record.domain),
            ("finish", record.finish),
        )
        if v is not None
    }
    components = {
        k: np.asarray(v, dtype=np.float32).reshape(-1) for k, v in (record.components or {}).items()
    }
    for k, v in components.items():
        if len(v) != n:
            raise ValueError(
                f"rollout record for step {step}: component {k} has {len(v)} values, expected {n}"
            )
    for k, v in texts.items():
        if len(v) != n:
            raise ValueError(
                f"rollout record for step {step}: {k} has {len(v)} entries, expected {n}"
            )
    return texts, components


def write_rollouts(path: Path, step: int, record: RolloutRecord) -> Path:
    """Write ``record`` to ``path`` atomically (rollhpc.rundir.atomic_file)."""
    path = Path(path)
    arrays = _per_sample_arrays(step, record)
    n = len(arrays["prompt_offsets"]) - 1
    texts, components = _optional_fields(step, record, n)
    episode = _episode_arrays(step, record, arrays["response_offsets"], n)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs.update(step=int(step), time=time.time(), n=n, format=FORMAT)
        for name, data in arrays.items():
            f.create_dataset(name, data=data)
        for k, v in texts.items():
            # HDF5 strings end at NUL; a policy may well write NUL bytes, kept visible as U+2400
            f.create_dataset(
                k, data=[t.replace("\x00", "\u2400") for t in v], dtype=h5py.string_dtype()
            )
        for k, v in components.items():
            f.create_dataset(f"components/{k}", data=v)
        for k, v in episode.items():
            f.create_dataset(k, data=v)
        if record.routes is not None:
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([len(r) for r in record.routes], out=offsets[1:])
            f.create_dataset("routes", data=np.concatenate(record.routes).astype(np.int16))
            f.create_dataset("route_offsets", data=offsets)
    return path


def _episode_arrays(
    step: int, record: RolloutRecord, response_off: np.ndarray, n: int
) -> dict[str, np.ndarray]:
    """The multi-turn fields, flattened and checked against the responses."""
    out: dict[str, np.ndarray] = {}
    if record.response_mask is not None:
        mask, mask_off = _flatten(record.response_mask, np.int8)
        if not np.array_equal(mask_off, response_off):
            raise ValueError(
                f"rollout record for step {step}: response_mask must have one value per response token"
            )
        out["response_mask"] = mask
    if (record.turn_ends is None) != (record.turn_rewards is None):
        raise ValueError(f"rollout record for step {step}: turn_ends and turn_rewards go together")
    if record.turn_ends is not None:
        ends, off = _flatten(record.turn_ends, np.int32)
        rewards, reward_off = _flatten(record.turn_rewards, np.float32)
        if not np.array_equal(off, reward_off) or len(off) != n + 1:
            raise ValueError(
                f"rollout record for step {step}: one turn_end and one turn_reward per turn, per sample"
            )
        out.update(turn_ends=ends, turn_rewards=rewards, turn_offsets=off)
    if record.success is not None:
        success = np.asarray(record.success, dtype=np.int8).reshape(-1)
        if len(success) != n:
            raise ValueError(
                f"rollout record for step {step}: success has {len(success)} values, expected {n}"
            )
        out["success"] = success
    return out


def read_rollouts(path: Path) -> dict[str, Any]:
    """The file as plain Python: ragged fields as lists of numpy arrays, texts as lists of str."""
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
        for k in ("prompt_text", "response_text", "domain", "finish"):
            out[k] = [s.decode() for s in f[k][()]] if k in f else None
        out["components"] = (
            {k: f["components"][k][()] for k in f["components"]} if "components" in f else {}
        )
        out["response_mask"] = (
            _split(f["response_mask"][()], response_off) if "response_mask" in f else None
        )
        if "turn_offsets" in f:
            turn_off = f["turn_offsets"][()]
            out["turn_ends"] = _split(f["turn_ends"][()], turn_off)
            out["turn_rewards"] = _split(f["turn_rewards"][()], turn_off)
        else:
            out["turn_ends"] = out["turn_rewards"] = None
        out["success"] = f["success"][()].astype(bool) if "success" in f else None
        out["routes"] = _split(f["routes"][()], f["route_offsets"][()]) if "routes" in f else None
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
