"""The tiny-model factory: specs are validated, the tokenizer keeps digits apart, and the written
directory loads offline in transformers (dense and MoE) and stops generating at EOS."""

from __future__ import annotations

import os

# nothing may come from the hub: every file must be in the directory
os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollhpc.tasks import arithmetic, countdown
from rollhpc.warm_start.tiny import (
    EOS_TOKEN,
    TinyModelConfig,
    build_tokenizer,
    create_tiny_model,
)
from rollhpc.warm_start.tiny_config import QWEN2_5_0_5B, QWEN2_5_0_5B_VOCAB

SAMPLES = [
    "123 + 456 = 579",
    "9071 - 88 = 8983\n",
    "Numbers: 3 7 25 50\nTarget: 46\nAnswer: (50 - 25) + 3 * 7",
    "Answer:  -12 .",
    "unseen words: zebra, quixotic! ~^",
]


@pytest.fixture(scope="module")
def tokenizer():
    train, _ = arithmetic.make_splits(0, 300, 0)
    cd, _ = countdown.make_splits(0, 300, 0)
    return build_tokenizer([*arithmetic.corpus(train), *countdown.corpus(cd)], vocab_size=300)


@pytest.fixture(scope="module")
def dense_dir(tokenizer, tmp_path_factory) -> Path:
    return create_tiny_model(
        tmp_path_factory.mktemp("m") / "dense", TinyModelConfig(), tokenizer, seed=0
    )


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_spec_defaults_fit_vllm():
    spec = TinyModelConfig()
    assert (
        spec.hidden_size,
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    ) == (128, 4, 2, 32)
    assert spec.tie_word_embeddings and not spec.moe


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(hidden_size=64),
            "head_dim = hidden_size / num_attention_heads = 16 but vLLM needs >= 32",
        ),
        (dict(hidden_size=130), "hidden_size 130 is not divisible by num_attention_heads 4"),
        (
            dict(num_key_value_heads=3),
            "num_attention_heads 4 is not divisible by num_key_value_heads 3",
        ),
        (
            dict(num_hidden_layers=0),
            "TinyModelConfig.num_hidden_layers must be a positive int, got 0",
        ),
        (dict(intermediate_size=2.5), "TinyModelConfig.intermediate_size must be a positive int"),
        (dict(moe=True, num_experts_per_tok=5), "num_experts_per_tok 5 exceeds num_experts 4"),
        (dict(moe=True, num_experts=0), "TinyModelConfig.num_experts must be a positive int"),
        (dict(rope_theta=0.0), "rope_theta"),
    ],
)
def test_bad_spec_is_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TinyModelConfig(**kwargs)


def test_tokenizer_isolates_digits_and_round_trips(tokenizer):
    tokens = tokenizer.tokenize("12345 + 678 = 13023")
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("12345678") + list("13023")
    for text in SAMPLES:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.eos_token_id not in ids  # encoding adds no special tokens
        assert tokenizer.decode(ids) == text
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        EOS_TOKEN,
        0,
        1,
    )
    assert 258 < len(tokenizer) <= 300  # vocab_size is a ceiling: a small corpus runs out of merges


def test_tokenizer_training_is_deterministic_and_checks_the_size(tokenizer):
    texts = list(arithmetic.corpus(arithmetic.make_splits(0, 300, 0)[0]))
    assert build_tokenizer(texts, 280).get_vocab() == build_tokenizer(texts, 280).get_vocab()
    with pytest.raises(ValueError, match="below the 258 tokens"):
        build_tokenizer(texts, 100)


def test_unmerged_characters_stay_one_token_each(tmp_path):
    board = "_____\n_#___\n__P__\n__B._\n"
    texts = [f"Push every B onto a . target.\n{board}> down\n"] * 50 + ["left right up down"] * 20
    merged = build_tokenizer(texts, 400)
    assert len(merged.tokenize(board)) < 10  # whole rows become tokens
    apart = build_tokenizer(texts, 400, unmerged="_#.B*P+\n")
    # one token per cell
    assert [apart.decode([i]) for i in apart(board)["input_ids"]] == list(board)
    assert apart.tokenize(" down") == merged.tokenize(" down")  # other merges stay
    apart.save_pretrained(tmp_path)  # ids of the kept tokens are contiguous, the specials first
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(board + "> down")["input_ids"] == apart(board + "> down")["input_ids"]
    assert sorted(loaded.get_vocab().values()) == list(range(len(loaded)))
    assert (loaded.eos_token_id, loaded.pad_token_id) == (0, 1)


def test_padded_vocabulary_has_the_size_asked_and_tokenizes_as_trained(tokenizer, tmp_path):
    texts = [
        *arithmetic.corpus(arithmetic.make_splits(0, 300, 0)[0]),
        *countdown.corpus(countdown.make_splits(0, 300, 0)[0]),
    ]
    padded = build_tokenizer(texts, vocab_size=300, pad_to=4096)
    assert len(padded) == 4096
    for text in SAMPLES:  # the reserved entries are never produced: the trained tokenization
        assert padded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert padded.decode([len(tokenizer), 4095]) == "<|reserved_0|><|reserved_{}|>".format(
        4095 - len(tokenizer)
    )
    with pytest.raises(ValueError, match="pad_to=200 is below"):
        build_tokenizer(texts, vocab_size=300, pad_to=200)
    spec = TinyModelConfig(num_hidden_layers=1, rope_theta=QWEN2_5_0_5B.rope_theta)
    model_dir = create_tiny_model(tmp_path / "m", spec, padded, dtype="bfloat16")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["vocab_size"], config["dtype"]) == (4096, "bfloat16")
    assert {t.dtype for t in _tensors(model_dir).values()} == {torch.bfloat16}
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 4096


def test_qwen2_5_0_5b_shape_has_its_published_parameter_count():
    from transformers import AutoModelForCausalLM

    config = QWEN2_5_0_5B.hf_config(QWEN2_5_0_5B_VOCAB, eos_token_id=0, pad_token_id=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Qwen2.5-0.5B's, embedding tied
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases


def test_dense_model_loads_offline_and_generates(tokenizer, dense_dir):
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in dense_dir.iterdir()
    }
    assert [p.name for p in dense_dir.parent.iterdir()] == ["dense"]  # no temp dir left beside it
    config = json.loads((dense_dir / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"]) == (["Qwen2ForCausalLM"], len(tokenizer))
    assert (
        json.loads((dense_dir / "generation_config.json").read_text())["eos_token_id"]
        == tokenizer.eos_token_id
    )

    tok = AutoTokenizer.from_pretrained(dense_dir)
    for (
        text
    ) in SAMPLES:  # transformers rebuilds qwen2 tokenizers: the loaded one must agree with ours
        assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    batch = tok(
        ["12 + 34 =", "Numbers: 3 7\nTarget: 21\nAnswer:"], return_tensors="pt", padding=True
    )
    with torch.no_grad():
        logits = model(**batch).logits
    assert (
        logits.shape == (*batch["input_ids"].shape, len(tokenizer)) and torch.isfinite(logits).all()
    )

    prompt = tok("12 + 34 =", return_tensors="pt")
    n = prompt["input_ids"].shape[1]
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == n + 6 or out[0, -1] == tok.eos_token_id
    # zero final norm: all logits equal, greedy picks id 0 = EOS, generation must stop
    with torch.no_grad():
        model.model.norm.weight.zero_()
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert out[0, n:].tolist() == [tok.eos_token_id]


def test_moe_model_builds_and_loads(tokenizer, tmp_path):
    model_dir = create_tiny_model(tmp_path / "moe", TinyModelConfig(moe=True), tokenizer)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "Qwen2MoeForCausalLM"
    ]
    names = _tensors(model_dir)
    # per-expert tensors, the layout vLLM's Qwen2-MoE loader reads
    assert {
        "model.layers.0.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.shared_expert.up_proj.weight",
        "model.layers.0.mlp.gate.weight",
    } <= set(names)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)("99 - 9 =", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_creation_is_seeded_atomic_and_leaves_the_callers_rng_alone(
    tokenizer, dense_dir, tmp_path, monkeypatch
):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    again = create_tiny_model(tmp_path / "again", TinyModelConfig(), tokenizer, seed=0)
    assert torch.equal(torch.rand(3), expected)
    a, b = _tensors(dense_dir), _tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = _tensors(create_tiny_model(tmp_path / "other", TinyModelConfig(), tokenizer, seed=1))
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])

    with pytest.raises(FileExistsError, match="already exists"):
        create_tiny_model(again, TinyModelConfig(), tokenizer)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        create_tiny_model(tmp_path / "crashed", TinyModelConfig(), tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other"]


VLLM_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: reload_weights gets tensors
os.environ["HF_HUB_OFFLINE"] = "1"

if __name__ == "__main__":  # vLLM may spawn helpers that re-import this file
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    model_dir, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=model_dir, max_model_len=128, max_num_seqs=2, seed=0, enforce_eager=True,
              kv_cache_memory_bytes=64 * 2**20)  # a fixed KV cache, not a fraction of the machine's memory
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results = []
    for zero_norm in (False, True):
        if zero_norm:  # all logits equal: greedy picks id 0, the EOS, and generation must stop there
            weights = load_file(os.path.join(model_dir, "model.safetensors"))
            weights["model.norm.weight"].zero_()
            llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights.items())))
        out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        results.append([list(out.token_ids), out.finish_reason])
    print("RESULT " + json.dumps(results))
"""


@pytest.mark.slow
def test_vllm_accepts_the_dense_model_and_matches_transformers(tokenizer, dense_dir, tmp_path):
    """Proves vLLM (CPU) loads the architecture, the tokenizer and the EOS setting, and that its
    greedy tokens equal transformers' for the same weights (~15 s: engine start dominates)."""
    import subprocess
    import sys

    prompt, max_tokens = "12 + 34 =", 5
    script = tmp_path / "vllm_generate.py"
    script.write_text(VLLM_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(dense_dir), prompt, str(max_tokens)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    (tokens, reason), (eos_tokens, eos_reason) = json.loads(lines[-1][len("RESULT ") :])

    model = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[
        0, ids.shape[1] :
    ].tolist()
    assert tokens == expected and reason == (
        "stop" if expected[-1] == tokenizer.eos_token_id else "length"
    )
    assert (eos_tokens, eos_reason) == ([tokenizer.eos_token_id], "stop")
