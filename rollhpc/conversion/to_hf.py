"""A megatron -> HF conversion, in one worker process (a world of one): megatron's loader reassembles any
layout, so the sharding arithmetic is only the TP=1 fusing (``unshard_to_hf`` of one shard). A meta-device
skeleton gives the checkpoint's keys and shapes, the HF files' headers are planned up front, then each
parameter is read alone, unfused and streamed into its safetensors file. Memory: one parameter's tensors.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rollhpc import file_modes
from rollhpc.checkpoint.mcore import McoreReader, single_process_world
from rollhpc.checkpoint.mcore_files import (
    HF_EXTRAS_DIR,
    copy_hf_extras,
    write_generation_config_if_missing,
)
from rollhpc.checkpoint.safetensors_io import PlannedTensor, SafetensorsWriter
from rollhpc.conversion.meters import Progress, reset_peak_rss, rss_bytes, worker_memory
from rollhpc.models.hf_weight_map import (
    LORA_ATTRIBUTE,
    WeightMapping,
    weight_map,
    hf_arch,
    unshard_to_hf,
)
from rollhpc.models.lora import adapter_of, peft_config, peft_tensors
from rollhpc.rundir import replace_dir

# a LoRA checkpoint's converted directory: its adapters in PEFT's format, here
ADAPTER_DIR = "adapter"


def convert_rank(rank: int, job: Mapping[str, Any]) -> dict[str, int]:
    """The checkpoint ``job["src"]`` written as the HF model directory ``job["dst"]`` (beside it first,
    then renamed into place); the worker's memory report and the number of HF tensors."""
    src, dst = Path(job["src"]), Path(job["dst"])
    with single_process_world():
        baseline = rss_bytes()
        reset_peak_rss()
        reader = McoreReader(src, checksums=job["checksums"])
        table = weight_map(hf_arch(reader.hf_config))
        plan = _planned_tensors(reader, table)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(file_modes.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
        try:
            _write_weights(reader, table, plan, tmp, job)
            _write_other_files(reader, src, tmp)
            _replace(tmp, dst, job["overwrite"])
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {**worker_memory(baseline), "tensors": len(plan)}


def _unshard_args(reader: McoreReader) -> dict[str, int]:
    """What ``unshard_to_hf`` needs of the model besides the tensors."""
    return dict(
        num_query_groups=reader.skeleton.config.num_query_groups,
        num_attention_heads=reader.skeleton.config.num_attention_heads,
        vocab_size=reader.vocab_size,
    )


def _planned_tensors(reader: McoreReader, table: list[WeightMapping]) -> list[PlannedTensor]:
    """Every HF tensor the conversion writes, its dtype and shape, from the meta-device skeleton."""
    skeleton = dict(reader.skeleton.named_parameters())
    kw = _unshard_args(reader)
    return [
        PlannedTensor(name, t.dtype, tuple(t.shape))
        for w in table
        for name, t in unshard_to_hf(w.layout, [skeleton[w.megatron]], w.hf, **kw).items()
    ]


def _write_weights(
    reader: McoreReader,
    table: list[WeightMapping],
    plan: list[PlannedTensor],
    tmp: Path,
    job: Mapping[str, Any],
) -> None:
    """The safetensors files of ``plan`` in ``tmp``, one megatron parameter read at a time."""
    kw = _unshard_args(reader)
    writer = SafetensorsWriter(tmp, plan, job["max_shard_bytes"])
    bar = Progress(len(table), f"writing {Path(job['dst']).name}", enabled=job["progress"])
    for w in table:
        full = reader.read([w.megatron])[w.megatron]
        # a LoRA checkpoint: its adapters merged in (W + alpha/r B A)
        if reader.lora is not None:
            full = _merged(reader, w.megatron, full)
        for name, tensor in unshard_to_hf(w.layout, [full], w.hf, **kw).items():
            writer.write(name, tensor)
        del full
        bar.update()
    bar.close()
    writer.close()


def _write_other_files(reader: McoreReader, src: Path, tmp: Path) -> None:
    """config.json, the source's other HF files (tokenizer, ...), a generation config, a LoRA adapter."""
    cfg = reader.hf_config
    if reader.lora is not None:
        _write_peft_adapter(reader, tmp / ADAPTER_DIR)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (src / HF_EXTRAS_DIR).is_dir():
        copy_hf_extras(src / HF_EXTRAS_DIR, tmp)
    # as save_pretrained would have: vLLM reads its EOS
    write_generation_config_if_missing(tmp, cfg)


def _write_peft_adapter(reader: McoreReader, out: Path) -> None:
    """A LoRA checkpoint's adapters as a PEFT adapter directory (adapter_model.safetensors, adapter_config.json):
    what `PeftModel.from_pretrained(base, out)` loads onto the base model the run started from."""
    c = reader.skeleton.config
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(c.num_layers):
        for target in reader.lora.target:
            prefix = f"decoder.layers.{layer}.{LORA_ATTRIBUTE}.{target}."
            ab = reader.read([prefix + "lora_a", prefix + "lora_b"])
            tensors.update(
                peft_tensors(
                    layer,
                    target,
                    ab[prefix + "lora_a"],
                    [ab[prefix + "lora_b"]],
                    c.num_query_groups,
                    c.num_attention_heads,
                )
            )
    out.mkdir()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors")
    )
    (out / "adapter_config.json").write_text(
        json.dumps(peft_config(reader.lora), indent=2, sort_keys=True) + "\n"
    )


def _merged(reader: McoreReader, name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (a full megatron tensor of ``reader``'s checkpoint) with its LoRA adapter merged in, when it has
    one: in megatron's layout, B's rows being the weight's (fused q/k/v, gate/up), before any split."""
    names = adapter_of(name, reader.lora)
    if names is None:
        return weight
    ab = reader.read(list(names))
    a, b = ab[names[0]].float(), ab[names[1]].float()
    return (weight.float() + reader.lora.scaling * (b @ a)).to(weight.dtype)


def _replace(tmp: Path, dst: Path, overwrite: bool) -> None:
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
    replace_dir(tmp, dst)
