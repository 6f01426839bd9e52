"""The LoRA adapter a vLLM engine serves (``max_lora_rank`` > 0): a LoRA trainer's synced adapters written as a
PEFT directory that vLLM's own LoRA support loads in place of the previous version's."""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.lora.request import LoRARequest

__all__ = ["AdapterSlot"]


class AdapterSlot:
    """The one LoRA adapter an engine serves: a PEFT directory in this process's scratch space (shared memory
    where the machine has it: vLLM's loader reads a path, also from its TP worker processes), rewritten for
    each version and loaded in place under one adapter id."""

    ADAPTER_ID = 1

    def __init__(self) -> None:
        shm = Path("/dev/shm")
        self.dir = Path(tempfile.mkdtemp(prefix="rollhpc-lora-", dir=shm if shm.is_dir() else None))
        # gone with the engine, or at exit
        weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.request: LoRARequest | None = None  # what requests name, once an adapter is loaded

    def write(self, tensors: dict[str, torch.Tensor]) -> LoRARequest:
        """Write ``tensors`` (HF module names, alpha/r already in B) as the adapter; returns the request that
        loads it in place."""
        a = [t for name, t in tensors.items() if ".lora_A." in name]
        if not a or len(a) * 2 != len(tensors):
            raise ValueError(
                f"LoRA adapters come as lora_A/lora_B pairs, got {sorted(tensors)[:4]}..."
            )
        rank = int(a[0].shape[0])
        modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
        save_file(
            {
                f"base_model.model.{k}": v.detach().to("cpu").contiguous()
                for k, v in tensors.items()
            },
            str(self.dir / "adapter_model.safetensors"),
        )
        # alpha = r: the scaling alpha/r is already in B
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": rank,
            "lora_dropout": 0.0,
            "target_modules": modules,
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
        }
        (self.dir / "adapter_config.json").write_text(json.dumps(config))
        self.request = LoRARequest("policy", self.ADAPTER_ID, str(self.dir))
        return LoRARequest("policy", self.ADAPTER_ID, str(self.dir), load_inplace=True)
