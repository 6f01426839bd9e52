"""The logits of the HF model (transformers) and of the megatron model loading the mcore checkpoint (a TP=1
``GPTModel``) on a few prompts, in a worker process of its own: the one part of a conversion that loads
transformers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from rollhpc.checkpoint.mcore import load_mcore_checkpoint, single_process_world
from rollhpc.checkpoint.mcore_files import read_metadata
from rollhpc.models.megatron_gpt import build_gpt_model

VERIFY_PROMPTS = ("The quick brown fox jumps over", "12 + 7 = 19; 3 + 4 =", "def fibonacci(n):")
DEFAULT_ATOL = 1e-3


def verify_rank(rank: int, job: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"verify": {"max_abs_diff", "per_prompt", "prompts", "atol", "argmax_agree", "ok"}}`` for the HF
    directory ``job["hf_dir"]`` and the checkpoint ``job["mcore_dir"]``."""
    hf_logging.disable_progress_bar()
    hf_dir, mcore_dir = Path(job["hf_dir"]), Path(job["mcore_dir"])
    with single_process_world():
        meta = read_metadata(mcore_dir, checksums=False)
        cfg = meta["hf_config"]
        # Both models in float32 (bf16/fp16 weights upcast exactly), so only the arithmetic differs.
        model = build_gpt_model(
            cfg,
            tp=1,
            params_dtype=torch.float32,
            parallel_output=False,
            padded_vocab=meta["padded_vocab_size"],
            perform_initialization=False,
        )
        load_mcore_checkpoint(model, mcore_dir)
        model.eval()
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        prompts = _verify_prompts(hf_dir, cfg["vocab_size"])
        diffs, agree = _compare(model, hf, prompts, cfg["vocab_size"])
    atol = job["atol"] if job["atol"] is not None else DEFAULT_ATOL
    worst = max(diffs)
    return {
        "verify": {
            "max_abs_diff": worst,
            "per_prompt": diffs,
            "prompts": len(prompts),
            "atol": atol,
            "argmax_agree": agree,
            "ok": worst <= atol,
        }
    }


def _compare(
    model: torch.nn.Module, hf: torch.nn.Module, prompts: list[list[int]], vocab: int
) -> tuple[list[float], float]:
    """Per prompt the largest |logit difference|, and the share of positions whose argmax agrees."""
    diffs, agree = [], 0.0
    with torch.no_grad():
        for ids in prompts:
            ids = torch.tensor([ids])
            ours = model(ids, torch.arange(ids.shape[1])[None], None)[..., :vocab]
            ref = hf(ids).logits
            diffs.append((ours - ref).abs().max().item())
            agree += (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() / len(prompts)
    return diffs, agree


def _verify_prompts(hf_dir: Path, vocab: int) -> list[list[int]]:
    """Token ids of VERIFY_PROMPTS with the model's tokenizer, or fixed pseudo-random ids without one."""
    try:
        tok = AutoTokenizer.from_pretrained(hf_dir)
        prompts = [tok(p)["input_ids"] for p in VERIFY_PROMPTS]
        if all(prompts) and all(0 <= i < vocab for p in prompts for i in p):
            return prompts
    except (OSError, ValueError, KeyError, TypeError):
        pass
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 16)]
