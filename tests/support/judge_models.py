"""A tiny judge model that has learnt one verdict: " YES" after any prompt in TEMPLATE's form.

A random tiny model never writes a verdict, so it can only test the unparsed path; this one (the session's
tiny policy fine-tuned for ~10 SFT steps, about a second) makes the parsed path testable too. It has not learnt to
judge: any prompt in the template's form gets YES, any other text gets no verdict ("hello" -> "ooooo").
Built once per test session (cached under pytest's session temp dir) for the engine and HTTP tests.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

TEMPLATE = "Q: {question}\nA: {response}\nRef: {reference}\nOK?"


def training_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    from rollhpc.rewards.judge import render_prompt
    from rollhpc.tasks import arithmetic

    rng = random.Random(seed)
    examples = arithmetic.make_splits(seed, n, 0, digits=2, ops=("+",))[0]
    kinds = [
        lambda e: e.answer,
        lambda e: str(rng.randint(0, 300)),
        lambda e: "",
        lambda e: f"{rng.randint(0, 99)} + {rng.randint(0, 99)}",
        lambda e: " ".join(["7"] * rng.randint(1, 6)),
    ]
    return [
        (
            render_prompt(
                TEMPLATE, question=e.prompt, response=rng.choice(kinds)(e), reference=e.answer
            ),
            " YES",
        )
        for e in examples
    ]


def yes_judge(base: Path, policy_dir: Path) -> Path:
    """The judge's HF directory under ``base`` (built on first call, reused after)."""
    out = base / "yes_judge"
    if (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollhpc.warm_start.sft import SftConfig, train_sft

    tmp = base / "yes_judge.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(policy_dir, tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    options = SftConfig(
        steps=100, batch_size=16, lr=5e-3, warmup=2, max_len=96, target_accuracy=1.0, check_every=3
    )
    result = train_sft(
        model,
        tok,
        training_pairs(320, 1),
        options,
        monitor_pairs=training_pairs(32, 2),
        progress=False,
    )
    assert result.reached_target, result
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out
