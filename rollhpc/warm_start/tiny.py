"""Tiny Qwen2-style checkpoints (dense or MoE) with a locally trained tokenizer.

The RLVR pipeline must run end to end on 2 CPU cores without downloading anything, so the policy
is built here: a tokenizer trained on the task corpus and a randomly initialised decoder, written
as an ordinary Hugging Face directory that transformers and vLLM load like any downloaded checkpoint.
The architecture is a real one (Qwen2 / Qwen2-MoE) at toy sizes rather than a bespoke model, so
the same code paths serve large checkpoints later; the sizes respect vLLM's limits (head_dim >= 32).

Prompt format: no chat template. A prompt is the task's plain text; the completion follows it
directly and ends with EOS, which transformers' ``generate`` and vLLM both stop on.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rollhpc import file_modes
from rollhpc.warm_start.tiny_config import TinyModelConfig

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
RESERVED_TOKEN = "<|reserved_{}|>"  # the vocabulary's padding entries (build_tokenizer's pad_to)


def build_tokenizer(
    texts: Iterable[str], vocab_size: int, unmerged: str = "", pad_to: int | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``; returns a Qwen2 tokenizer (a ``PreTrainedTokenizerFast``).

    ``vocab_size`` is a ceiling: a small corpus runs out of merges first, so size models by ``len(tok)``.
    ``pad_to``: the vocabulary then has exactly this many entries, the trained ones followed by ``<|reserved_N|>``
    entries that no merge produces (encoding never emits them; decoding gives their text). A model sized by
    ``len(tok)`` then has a real model's embedding and output layer, e.g. Qwen2.5's 151936 rows, however small the
    corpus; the tokenization is the trained one.

    Byte-level so that any text round-trips (no unknown token). The normaliser and pre-tokenizer are
    Qwen2's own, taken from transformers rather than chosen here: transformers 5 rebuilds the
    pre-tokenizer of any ``qwen2`` model directory from ``Qwen2Tokenizer`` whatever tokenizer.json
    says, so training with a different one would make the loaded tokenizer disagree with this one.
    Qwen2's regex isolates every digit, so numbers are never merged and arithmetic stays learnable
    digit by digit. EOS and PAD are special tokens with ids 0 and 1; encoding adds neither
    (prompts carry no EOS; the trainer appends it to completions).

    ``unmerged``: characters never merged with anything (they stay one token each), e.g. the cells of a
    text grid: a row of a 5-wide board is then always 5 tokens, so "the cell below" is always the same
    distance away, where merged runs like ``__B`` would make every row a different puzzle for a tiny model.
    The trained merges that involve them are dropped, with every merge built on those.
    """
    base = len(pre_tokenizers.ByteLevel.alphabet()) + 2  # 256 byte symbols plus EOS and PAD
    if vocab_size < base:
        raise ValueError(
            f"vocab_size {vocab_size} is below the {base} tokens a byte-level tokenizer needs"
        )
    reference = Qwen2Tokenizer().backend_tokenizer
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = reference.normalizer
    tok.pre_tokenizer = reference.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab, merges = trained["vocab"], [tuple(m) for m in trained["merges"]]
    if unmerged:
        vocab, merges = _without_merges_of(vocab, merges, unmerged)
    if pad_to is not None:
        vocab = _padded(vocab, pad_to)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )


def _without_merges_of(
    vocab: dict[str, int], merges: list[tuple[str, str]], chars: str
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """``vocab`` and ``merges`` without any merge whose parts hold one of ``chars`` (byte-level symbols), nor
    any built on a dropped one; ids renumbered in their old order, so specials and bytes keep theirs."""
    symbols = {_byte_symbol(c) for c in chars}
    merged = set()
    kept_merges = []
    for a, b in merges:
        token = a + b
        parts_ok = all(p in vocab and (len(p) == 1 or p in merged) for p in (a, b))
        if parts_ok and not any(ch in symbols for ch in token):
            kept_merges.append((a, b))
            merged.add(token)
    kept = [
        t
        for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])
        if len(t) == 1 or t in merged or t.startswith("<|")
    ]
    return {t: i for i, t in enumerate(kept)}, kept_merges


def _padded(vocab: dict[str, int], size: int) -> dict[str, int]:
    """``vocab`` with ``RESERVED_TOKEN`` entries appended up to ``size`` entries (ids ``len(vocab)`` .. ``size - 1``)."""
    if size < len(vocab):
        raise ValueError(
            f"pad_to={size} is below the {len(vocab)} tokens the trained vocabulary already has"
        )
    out = dict(vocab)
    for i in range(size - len(vocab)):
        token = RESERVED_TOKEN.format(i)
        if token in out:
            raise ValueError(f"the trained vocabulary already has {token!r}")
        out[token] = len(vocab) + i
    return out


def _byte_symbol(char: str) -> str:
    """The byte-level BPE symbol of a one-byte character (GPT-2's bytes-to-unicode table)."""
    if ord(char) > 255:
        raise ValueError(f"unmerged characters must be single bytes, got {char!r}")
    return bytes_to_unicode()[ord(char)]


def create_tiny_model(
    out_dir: Path,
    spec: TinyModelConfig,
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised model and ``tokenizer`` to ``out_dir``; returns ``out_dir``.

    The directory is built beside the target and renamed into place, so a crash leaves either a
    complete model or none. An existing ``out_dir`` is an error rather than silently replaced.
    Initialisation is seeded without disturbing the caller's torch RNG. ``dtype``: of the saved weights and
    the config's ``dtype`` ("bfloat16" as Qwen2.5's published checkpoints); initialised in float32 either way.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another directory")
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs eos and pad tokens (use build_tokenizer)")
    config = spec.hf_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(file_modes.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if dtype != "float32":
            model = model.to(getattr(torch, dtype))
            model.config.dtype = dtype
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=False,
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
