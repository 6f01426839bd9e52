"""VllmGenerator (CPU vLLM) against the transformers model with the same weights.

Two tiny random Qwen2 checkpoints (a, b) are written to a temporary folder; one subprocess
(tests/vllm_engine_probe.py) starts a single engine on a, generates, swaps in b's weights, swaps
back to a, drives the step API (add_request / step / abort, partial-rollout resume), and reports as
JSON. Here the transformers models give the expected greedy tokens and
log-probabilities. Throughput and update time are printed, not asserted.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_probe

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")

VOCAB = 300
MAX_TOKENS = 12
PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [77]]


def tiny_qwen2(seed: int):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,  # head_dim 32
        intermediate_size=256, num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.1,  # sharper logits than the default 0.02: fewer near-ties in greedy argmax
    )
    config._attn_implementation = "eager"
    return transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float], float]:
    """Greedy continuation, log-softmax of each chosen token, and the smallest top-1/top-2 logit gap."""
    ids = list(prompt)
    tokens, logprobs, gap = [], [], math.inf
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        top2 = logits.topk(2).values
        gap = min(gap, float(top2[0] - top2[1]))
        tok = int(logits.argmax())
        tokens.append(tok)
        logprobs.append(float(logits.log_softmax(-1)[tok]))
        ids.append(tok)
    return tokens, logprobs, gap


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_engine")
    refs = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_qwen2(seed)
        refs[name] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
        if name == "a":  # EOS: a's 6th greedy token after prompt 0, so at least one greedy run stops on it
            eos = refs["a"][0][0][5]
        model.generation_config.eos_token_id = eos
        model.save_pretrained(work / name, safe_serialization=True)
    spec = {"model_a": str(work / "a"), "model_b": str(work / "b"), "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    res = run_probe("vllm_engine_probe.py", spec, work)
    print(json.dumps({k: res[k] for k in ("start_s", "tokens_per_s", "update_weights_s", "update_weights_again_s")}))
    refs["eos"] = eos
    return res, refs


def assert_matches(got: list[dict], ref: list[tuple], logprob_atol: float = 1e-3) -> None:
    for g, (tokens, logprobs, gap) in zip(got, ref, strict=True):
        assert g["token_ids"] == tokens, f"vLLM {g['token_ids']} != transformers {tokens} (min logit gap {gap:.2e})"
        assert g["finish_reason"] == "length"
        assert g["logprobs"] == pytest.approx(logprobs, abs=logprob_atol)


def test_greedy_equals_transformers(probe):
    res, refs = probe
    assert_matches(res["greedy_a"], refs["a"])


def test_stops_at_eos_from_generation_config(probe):
    res, refs = probe
    for got, (tokens, _, _) in zip(res["greedy_eos"], refs["a"], strict=True):
        if refs["eos"] in tokens:
            expected = tokens[: tokens.index(refs["eos"]) + 1]  # the EOS token is kept
            assert (got["token_ids"], got["finish_reason"]) == (expected, "stop")
        else:
            assert (got["token_ids"], got["finish_reason"]) == (tokens, "length")


def test_update_weights_takes_effect_and_repeats(probe):
    res, refs = probe
    assert [g["token_ids"] for g in res["greedy_a"]] != [r[0] for r in refs["b"]], "a and b must differ"
    assert_matches(res["greedy_b"], refs["b"])
    assert res["version_after_b"] == 1 and res["completion_version_b"] == 1
    assert_matches(res["greedy_a_again"], refs["a"])
    assert res["version_after_a"] == 2
    assert_matches(res["greedy_after_wake"], refs["a"][:1])


def test_sampling_n_and_seed(probe):
    res, _ = probe
    first, again, other = res["sample_seed7"], res["sample_seed7_again"], res["sample_seed8"]
    assert len(first) == len(PROMPTS) and all(len(per_prompt) == 4 for per_prompt in first)
    assert first == again
    assert first != other
    for per_prompt in first:
        assert len({tuple(c["token_ids"]) for c in per_prompt}) > 1, "the 4 samples of a prompt should differ"
        for c in per_prompt:
            assert 0 < len(c["token_ids"]) <= MAX_TOKENS and len(c["logprobs"]) == len(c["token_ids"])
            assert all(lp <= 1e-6 and math.isfinite(lp) for lp in c["logprobs"])


def test_seeded_long_prompts_arriving_together_are_not_split(probe):
    assert probe[0]["seeded_long_prompts_finished"] == 40


def test_engine_reports(probe):
    res, _ = probe
    assert res["tokens_per_s"] > 0 and res["update_weights_s"] > 0


def test_first_generate_compiles_nothing_on_cpu(probe):
    """vLLM's compiled token-rank count would be built by inductor at the first step (2 s with a warm cache,
    13 s with a cold one): on CPU the engine uses the plain function (greedy_a, generated first, still
    equals transformers: test_greedy_equals_transformers)."""
    res, _ = probe
    assert not res["sampler_rank_compiled"], f"first generate took {res['first_generate_s']:.1f} s"


def test_step_api_matches_generate(probe):
    """Requests fed one by one and driven by step() give generate()'s greedy tokens and logprobs."""
    res, refs = probe
    step = res["step_api"]
    assert_matches(step["greedy"], refs["a"])
    assert [g["version"] for g in step["greedy"]] == [2] * len(PROMPTS)
    for got, want in zip(step["greedy_eos"], res["greedy_eos"], strict=True):  # same EOS handling
        assert (got["token_ids"], got["finish_reason"]) == (want["token_ids"], want["finish_reason"])
    assert_matches(res["greedy_after_step_api"], refs["a"])


def test_step_returns_requests_as_they_finish(probe):
    step = probe[0]["step_api"]
    assert step["unfinished_ids"] == ["short", "long"]
    assert step["lengths"] == {"short": 2, "long": MAX_TOKENS}
    assert step["finished_at"]["short"] < step["finished_at"]["long"]


def test_abort_returns_partial_and_resume_continues(probe):
    """Partial rollout: the aborted half (version 2) plus the resumed half (version 3, same weights)
    equal the uninterrupted greedy completion."""
    res, refs = probe
    step = res["step_api"]
    assert step["cut_before_abort"] == [] and step["aborted_ids"] == ["cut"] and step["abort_again"] == []
    partial, resumed = step["partial"], step["resumed"]
    assert 0 < len(partial["token_ids"]) < MAX_TOKENS and len(partial["logprobs"]) == len(partial["token_ids"])
    assert partial["finish_reason"] == "abort"
    assert step["unfinished_after_abort"] == [0, 0, False]
    tokens, logprobs, _ = refs["a"][0]
    assert partial["token_ids"] + resumed["token_ids"] == tokens
    assert partial["logprobs"] + resumed["logprobs"] == pytest.approx(logprobs, abs=1e-3)
    assert (partial["version"], resumed["version"], resumed["finish_reason"]) == (2, 3, "length")


def test_sleep_and_a_wake_of_the_weights_alone(probe):
    res = probe[0]
    assert res["asleep"] == {"update_weights": "RuntimeError", "generate": "RuntimeError"}
    assert res["weights_awake"] == {"update_weights": "none", "generate": "RuntimeError"}
    assert res["greedy_after_partial_wake"] == res["greedy_after_wake"]


def test_step_api_refuses_misuse(probe):
    step = probe[0]["step_api"]
    assert step["errors"] == {"duplicate": "ValueError", "update_weights": "RuntimeError",
                              "generate": "RuntimeError", "sleep": "RuntimeError"}
    assert step["version_after_refused_update"] == 3
    assert step["dup_aborted"] == ["dup"]
