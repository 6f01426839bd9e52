"""TorchGenerator (``engine: torch``) against the transformers model with the same weights, in process.

Tiny random checkpoints: a Qwen2 (q/k/v biases, grouped-query attention, untied head, EOS in its
generation_config.json), a Llama (no biases, tied embeddings) and a Qwen2-MoE (TinyModelConfig(moe=True): 4
experts, top 2, renormalised, a shared expert). Greedy tokens and log-probabilities must be transformers' own,
and a MoE completion's routes transformers' own routing of the tokens it fed; sampled log-probabilities must be those of the distribution after temperature and
top-p; the step API must give what ``generate`` gives when requests wait for KV cache slots, finish out of
order (the running ones are moved to stay packed) and are aborted and resumed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollhpc.engines.torch_engine import TorchGenerator  # noqa: E402
from rollhpc.warm_start.tiny_config import TinyModelConfig  # noqa: E402

VOCAB = 300
PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [77]]


def _save(model, path: Path, eos: int | None = None) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    gen = path / "generation_config.json"
    if eos is not None:
        gen.write_text(json.dumps({"eos_token_id": eos}))
    elif gen.exists():
        gen.unlink()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("torch_engine")
    out = {}
    for name, seed in (("qwen_a", 0), ("qwen_b", 1)):
        torch.manual_seed(seed)
        config = transformers.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            num_hidden_layers=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            initializer_range=0.1,
        )
        model = transformers.Qwen2ForCausalLM(config).eval()
        # model a's EOS is the third token of its greedy answer to the first prompt: "stop" really happens
        eos = hf_greedy(model, PROMPTS[0], 3)[0][2] if name == "qwen_a" else None
        out[name] = (model, _save(model, root / name, eos=eos))
        out[f"{name}_eos"] = eos
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    out["llama"] = (model, _save(model, root / "llama"))
    torch.manual_seed(3)
    spec = TinyModelConfig(moe=True, tie_word_embeddings=False, initializer_range=0.1)
    model = transformers.Qwen2MoeForCausalLM(spec.hf_config(VOCAB, VOCAB - 1, VOCAB - 2)).eval()
    # as qwen_a: its EOS is the third token of its greedy answer to the first prompt
    out["moe_eos"] = eos = hf_greedy(model, PROMPTS[0], 3)[0][2]
    out["moe"] = (model, _save(model, root / "moe", eos=eos))
    return out


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(
    model, prompt: list[int], steps: int, eos: int | None = None
) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(steps):
        logits = hf_logits(model, ids)[-1]
        tok = int(logits.argmax())
        tokens.append(tok)
        logprobs.append(float(logits.log_softmax(-1)[tok]))
        ids.append(tok)
        if tok == eos:
            break
    return tokens, logprobs


@torch.no_grad()
def hf_routes(model, ids: list[int]) -> np.ndarray:
    """Transformers' routing of ``ids``: the top-k experts of every position in each MoE layer [len, layers, k]."""
    out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([r.topk(k, dim=-1).indices for r in out.router_logits], dim=1).numpy()


def assert_routes(model, prompt: list[int], c) -> None:
    """``c.routes`` is transformers' routing of every token fed: the prompt and every sampled one but the last."""
    fed = prompt + c.token_ids[:-1]
    assert c.routes.dtype == np.int16
    assert c.routes.shape == (len(fed), model.config.num_hidden_layers, 2)
    np.testing.assert_array_equal(c.routes, hf_routes(model, fed))


@pytest.mark.parametrize("name", ["qwen_a", "llama", "moe"])
def test_greedy_equals_transformers_and_stops_at_eos(models, name):
    model, path = models[name]
    engine = TorchGenerator(path, max_model_len=64)
    eos = models.get(f"{name}_eos")
    out = engine.generate(PROMPTS, temperature=0.0, max_tokens=10)
    for prompt, (c,) in zip(PROMPTS, out):
        tokens, logprobs = hf_greedy(model, prompt, 10, eos)
        assert c.token_ids == tokens
        assert c.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert c.finish_reason == ("stop" if tokens[-1] == eos else "length")
        assert c.version == 0
        assert (c.routes is None) == (name != "moe")  # a dense model records no routes
    # the random model must really hit its EOS somewhere, or "stop" went untested
    if name != "llama":
        assert any(c.finish_reason == "stop" for (c,) in out)


def test_sampled_logprobs_are_those_of_the_tempered_nucleus(models):
    """temperature 0.7, top-p 0.8: each sampled token lies in the nucleus of softmax(logits / 0.7) and its
    log-probability is its renormalized one there; the same seed gives the same samples. The 3 samples of a
    prompt share its prefill (keys and values copied into their slots); a request alone samples the same."""
    model, path = models["qwen_b"]
    engine = TorchGenerator(path, max_model_len=64)
    out = engine.generate(PROMPTS[:2], n=3, temperature=0.7, top_p=0.8, max_tokens=6, seed=11)
    again = engine.generate(PROMPTS[:2], n=3, temperature=0.7, top_p=0.8, max_tokens=6, seed=11)
    assert [[c.token_ids for c in row] for row in out] == [
        [c.token_ids for c in row] for row in again
    ]
    assert len({tuple(c.token_ids) for row in out for c in row}) > 1
    for prompt, row in zip(PROMPTS, out):
        for c in row:
            logits = hf_logits(model, prompt + c.token_ids)[len(prompt) - 1 : -1] / 0.7
            for t, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
                probs = logits[t].softmax(-1)
                sorted_p, order = probs.sort(descending=True)
                keep = order[(sorted_p.cumsum(0) - sorted_p) < 0.8]
                assert tok in keep.tolist()
                assert lp == pytest.approx(
                    math.log(float(probs[tok] / probs[keep].sum())), abs=1e-4
                )
    # a step-API request with a seed samples what generate's sample with that stream did
    engine.add_request(
        "x", PROMPTS[1], temperature=0.7, top_p=0.8, max_tokens=6, seed=11 + 1 * 3 + 2
    )
    ((rid, c),) = engine.run_until()
    assert rid == "x" and c.token_ids == out[1][2].token_ids


def test_step_api_with_few_slots_abort_and_resume(models):
    """A KV cache with room for 2 requests: 4 greedy requests wait for slots, finish at different steps and
    give generate's completions; an aborted request hands back its partial, and resuming from prompt +
    partial continues exactly where the uninterrupted completion went."""
    model, path = models["qwen_b"]
    engine = TorchGenerator(
        path, max_model_len=64, cpu_kv_cache_bytes=2 * (2 * 2 * 2 * 64 * 32 * 4)
    )
    assert engine.slots == 2
    want = {f"r{i}": hf_greedy(model, p, 13 - 3 * i)[0] for i, p in enumerate(PROMPTS)}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, temperature=0.0, max_tokens=13 - 3 * i)
    order = []
    while engine.num_unfinished():
        for rid, c in engine.step():
            order.append(rid)
            assert c.token_ids == want[rid] and c.finish_reason == "length"
    assert sorted(order) == sorted(want) and order != sorted(want)

    full = hf_greedy(model, PROMPTS[2], 9)[0]
    engine.add_request("long", PROMPTS[2], temperature=0.0, max_tokens=9)
    engine.add_request("waits", PROMPTS[0], temperature=0.0, max_tokens=9)
    engine.add_request("also", PROMPTS[1], temperature=0.0, max_tokens=9)
    engine.step(), engine.step(), engine.step()
    partials = dict(engine.abort(["long", "waits", "unknown"]))
    assert partials["long"].finish_reason == "abort" and partials["long"].token_ids == full[:3]
    # "also" waited for a slot
    assert partials["waits"].token_ids == hf_greedy(model, PROMPTS[0], 3)[0]
    assert engine.unfinished_ids() == ["also"]
    engine.add_request(
        "long2", PROMPTS[2] + partials["long"].token_ids, temperature=0.0, max_tokens=6
    )
    done = dict(engine.run_until(min_finished=2))
    assert partials["long"].token_ids + done["long2"].token_ids == full
    assert done["also"].token_ids == hf_greedy(model, PROMPTS[1], 9)[0]


def test_update_weights_and_misuse(models):
    """New weights (HF names) take effect and are recorded as the version; what would mix versions or
    cannot run is refused with a clear error."""
    (model_a, path_a), (model_b, _) = models["qwen_a"], models["qwen_b"]
    engine = TorchGenerator(path_a, max_model_len=32)
    engine.update_weights(list(model_b.state_dict().items()), version=5)
    ((c,),) = engine.generate([PROMPTS[0]], temperature=0.0, max_tokens=8)
    assert (
        c.token_ids == hf_greedy(model_b, PROMPTS[0], 8, models["qwen_a_eos"])[0] and c.version == 5
    )

    engine.add_request("a", PROMPTS[0], max_tokens=4)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("a", PROMPTS[0])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights(list(model_a.state_dict().items()), version=6)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.generate([PROMPTS[0]])
    engine.abort(["a"])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("b", list(range(32)))
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_request("c", PROMPTS[0])
    engine.wake_up()

    config = json.loads((path_a / "config.json").read_text())
    other = path_a.parent / "gpt2ish"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="engine=vllm"):
        TorchGenerator(other)


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapters(model, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """LoRA adapters on every linear of ``model`` as a weight sync sends them (HF module names, alpha/r in B)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in model.state_dict().items():
        if name.endswith(".weight") and name.split(".")[-2] in LORA_MODULES:
            module = name[: -len(".weight")]
            out[f"{module}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.1
            out[f"{module}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.1
    return out


def merged_model(model, adapters: dict[str, torch.Tensor]):
    """A copy of ``model`` with ``adapters`` merged into its weights (W + B A)."""
    import copy

    out = copy.deepcopy(model)
    state = out.state_dict()
    for name in state:
        a = adapters.get(name.replace(".weight", ".lora_A.weight"))
        if a is not None:
            state[name] += adapters[name.replace(".weight", ".lora_B.weight")] @ a
    out.load_state_dict(state)
    return out


def test_adapters_are_served_merged_and_replace_the_last(models):
    """A LoRA trainer's sync (adapters alone): the engine serves base + B A, transformers' merged model's own
    greedy tokens and log-probs; the next version's adapters replace the last ones (B = 0: the base again)."""
    model, path = models["qwen_b"]
    engine = TorchGenerator(path, max_model_len=32)
    adapters = random_adapters(model, rank=4, seed=0)
    engine.update_weights(list(adapters.items()), version=1)
    want = [hf_greedy(merged_model(model, adapters), p, 6) for p in PROMPTS[:2]]
    got = engine.generate(PROMPTS[:2], temperature=0.0, max_tokens=6)
    for (c,), (tokens, logprobs) in zip(got, want):
        assert c.token_ids == tokens and c.version == 1
        assert max(abs(x - y) for x, y in zip(c.logprobs, logprobs)) < 1e-4
    zero = {k: v * 0 if ".lora_B." in k else v for k, v in adapters.items()}
    engine.update_weights(list(zero.items()), version=2)
    ((c,),) = engine.generate([PROMPTS[0]], temperature=0.0, max_tokens=6)
    assert c.token_ids == hf_greedy(model, PROMPTS[0], 6)[0]


def test_moe_routes_are_transformers_routing(models):
    """A Qwen2-MoE completion's routes are transformers' routing (top-k of each layer's router logits) of every
    token it fed, position by position: greedy and sampled completions, two samples sharing their prompt's
    prefill (the leader's prompt routes copied), and partials aborted while running (prompt + T - 1 rows) or
    still waiting for a slot (none)."""
    model, path = models["moe"]
    engine = TorchGenerator(path, max_model_len=64)
    greedy = engine.generate(PROMPTS, temperature=0.0, max_tokens=8)
    sampled = engine.generate(PROMPTS[:2], n=2, temperature=1.0, max_tokens=8, seed=5)
    assert any(row[0].token_ids != row[1].token_ids for row in sampled)
    for prompt, row in zip(PROMPTS, greedy):
        assert_routes(model, prompt, row[0])
    for prompt, row in zip(PROMPTS, sampled):
        for c in row:
            assert_routes(model, prompt, c)

    one_slot = TorchGenerator(path, max_model_len=64, cpu_kv_cache_bytes=2 * 2 * 2 * 64 * 32 * 4)
    assert one_slot.slots == 1
    one_slot.add_request("runs", PROMPTS[2], max_tokens=9, seed=1, ignore_eos=True)
    one_slot.add_request("waits", PROMPTS[0], max_tokens=9)
    one_slot.step(), one_slot.step(), one_slot.step()
    partials = dict(one_slot.abort(["runs", "waits"]))
    assert len(partials["runs"].token_ids) == 3
    assert_routes(model, PROMPTS[2], partials["runs"])
    assert partials["waits"].token_ids == [] and partials["waits"].routes.shape == (0, 2, 2)

    # MoE blocks on some layers only: refused, as the trainer's weight map is
    config = json.loads((path / "config.json").read_text())
    for key, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2)):
        other = path.parent / f"moe_{key}"
        other.mkdir()
        (other / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=f"{key}.*engine=vllm"):
            TorchGenerator(other)
