"""The files of a megatron-core dist checkpoint that rollhpc adds and reads without torch or megatron.

A checkpoint directory (``checkpoint.mcore`` writes it) is megatron's ``torch_dist`` format plus:

* ``rollhpc_checkpoint.json`` (``META_FILE``): format name and version, the Hugging Face ``config.json`` the
  model was built from, the parallel layout it was saved with, the padded vocab size, the parameter dtype, and a
  manifest of every file (size, and sha256 when computed), so that a missing or truncated file is reported as
  such before megatron reads anything;
* ``hf/`` (``HF_EXTRAS_DIR``): the source Hugging Face directory's other files (tokenizer, generation config),
  copied so that a conversion back to HF gives a complete model directory.

What reads them here (the metadata check, the manifest, the HF files) runs in the calling process of a
conversion, in ``rollhpc export`` and ``rollhpc ckpt inspect``: none of it needs the model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMAT = "rollhpc-mcore"
FORMAT_VERSION = 1
META_FILE = "rollhpc_checkpoint.json"
HF_EXTRAS_DIR = "hf"
GENERATION_CONFIG = "generation_config.json"
# HF files never copied into hf/: weights (converted) and config.json (kept in the metadata json).
_HF_SKIP = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_HF_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_GENERATION_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
_REQUIRED_KEYS = ("hf_config", "layout", "padded_vocab_size", "params_dtype", "files")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written: missing, incomplete, corrupt or mismatched."""


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def file_manifest(ckpt_dir: Path, checksums: bool) -> dict[str, dict[str, Any]]:
    """{relative path: {"size": bytes[, "sha256": hex]}} for megatron's files in ``ckpt_dir``."""
    out = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt_dir).as_posix()
        if rel == META_FILE or rel.startswith(HF_EXTRAS_DIR + "/"):
            continue
        out[rel] = {"size": path.stat().st_size} | (
            {"sha256": sha256_file(path)} if checksums else {}
        )
    return out


def copy_hf_extras(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy a Hugging Face directory's non-weight files (tokenizer, generation config, ...) from
    ``src_dir`` into ``dst_dir``; returns their names. config.json and weights are left out."""
    copied = []
    for path in sorted(Path(src_dir).iterdir()):
        if not path.is_file() or path.name in _HF_SKIP or path.suffix in _HF_SKIP_SUFFIXES:
            continue
        dst_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst_dir / path.name)
        copied.append(path.name)
    return copied


def generation_config_from(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The generation_config.json transformers' ``GenerationConfig.from_model_config`` derives from a
    config.json (its special token ids that are set; ``_from_model_config`` marks it as derived): what
    ``save_pretrained`` would have written beside the weights. vLLM stops at its ``eos_token_id``."""
    ids = {k: hf_config[k] for k in _GENERATION_TOKEN_IDS if hf_config.get(k) is not None}
    return {"_from_model_config": True, **ids}


def write_generation_config_if_missing(model_dir: Path, hf_config: Mapping[str, Any]) -> bool:
    """Give an HF directory whose source had no generation_config.json one derived from its config
    (``generation_config_from``), so that an exported model is complete; True if one was written."""
    path = Path(model_dir) / GENERATION_CONFIG
    if path.exists():
        return False
    path.write_text(json.dumps(generation_config_from(hf_config), indent=2, sort_keys=True) + "\n")
    return True


def read_metadata(ckpt_dir: str | Path, *, checksums: bool = True) -> dict[str, Any]:
    """The checkpoint's metadata, after checking that it is ours, of a known version, and that every file
    in its manifest is there with its size (and sha256, when recorded and ``checksums``)."""
    ckpt_dir = Path(ckpt_dir)
    meta = _load_meta(ckpt_dir)
    problems = _manifest_problems(ckpt_dir, meta["files"], checksums)
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} is incomplete or corrupt: {'; '.join(problems)}"
        )
    return meta


def _load_meta(ckpt_dir: Path) -> dict[str, Any]:
    """``META_FILE`` of ``ckpt_dir`` once it is known to be of our format and version, with every key."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    path = ckpt_dir / META_FILE
    if not path.is_file():
        hint = (
            " (it looks like a Hugging Face directory: convert it with hf-to-mcore)"
            if (ckpt_dir / "config.json").is_file()
            else ""
        )
        raise CheckpointError(
            f"{ckpt_dir} is not a rollhpc megatron checkpoint: {META_FILE} is missing{hint}"
        )
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable or corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
            f"expected {FORMAT!r}"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {meta.get('format_version')!r}; this rollhpc reads "
            f"version {FORMAT_VERSION}"
        )
    for key in _REQUIRED_KEYS:
        if key not in meta:
            raise CheckpointError(f"{path} lacks {key!r}")
    return meta


def _manifest_problems(
    ckpt_dir: Path, files: Mapping[str, Mapping[str, Any]], checksums: bool
) -> list[str]:
    """What differs between the manifest and the files: missing, another size, another sha256."""
    problems = []
    for rel, info in files.items():
        f = ckpt_dir / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != info["size"]:
            problems.append(f"{rel} has {f.stat().st_size} bytes, the manifest says {info['size']}")
        elif checksums and "sha256" in info and sha256_file(f) != info["sha256"]:
            problems.append(f"{rel} does not match its sha256 (corrupt)")
    return problems
