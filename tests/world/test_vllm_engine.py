"""VllmGenerator (CPU vLLM) against the transformers model with the same weights.

Two tiny random Qwen2 checkpoints (a, b) are written to a temporary folder; one subprocess
(tests/support/vllm_engine_probe.py) starts a single engine on a, generates, swaps in b's weights, swaps
back to a, drives the step API (add_request / step / abort, partial-rollout resume), and reports as
JSON. Here the transformers models give the expected greedy tokens and
log-probabilities. Throughput and update time are printed, not asserted.

A second engine runs with the GPU defaults forced on CPU (engine core in its own process, compiled, unseeded):
generation, abort and a weight update through vLLM's weight-transfer protocol. The speed options' validation
needs no engine.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from rollhpc.config import ConfigError, from_dict
from rollhpc.engines.config import EngineConfig
from rollhpc.engines.vllm_choices import VllmChoices, resolve_vllm_choices
from tests.support.processes import run_probe

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
        vocab_size=VOCAB,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 32
        intermediate_size=256,
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
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
def checkpoints(tmp_path_factory):
    """Checkpoints a and b, the probes' spec, and transformers' greedy references (refs["eos"]: a's EOS id)."""
    work = tmp_path_factory.mktemp("vllm_engine")
    refs = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_qwen2(seed)
        refs[name] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
        # EOS: a's 6th greedy token after prompt 0, so at least one greedy run stops on it
        if name == "a":
            eos = refs["a"][0][0][5]
        model.generation_config.eos_token_id = eos
        model.save_pretrained(work / name, safe_serialization=True)
    spec = {
        "model_a": str(work / "a"),
        "model_b": str(work / "b"),
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
    }
    refs["eos"] = eos
    return work, spec, refs


@pytest.fixture(scope="module")
def probe(checkpoints):
    work, spec, refs = checkpoints
    (work / "same").mkdir()
    res = run_probe("vllm_engine_probe.py", spec, work / "same")
    print(
        json.dumps(
            {
                k: res[k]
                for k in ("start_s", "tokens_per_s", "update_weights_s", "update_weights_again_s")
            }
        )
    )
    return res, refs


@pytest.fixture(scope="module")
def separate_probe(checkpoints):
    work, spec, refs = checkpoints
    (work / "separate").mkdir()
    res = run_probe(
        "vllm_engine_probe.py", {**spec, "engine_process": "separate"}, work / "separate"
    )
    print(json.dumps({k: res[k] for k in ("start_s", "update_weights_s")}))
    return res, refs


def assert_matches(got: list[dict], ref: list[tuple], logprob_atol: float = 1e-3) -> None:
    for g, (tokens, logprobs, gap) in zip(got, ref, strict=True):
        assert g["token_ids"] == tokens, (
            f"vLLM {g['token_ids']} != transformers {tokens} (min logit gap {gap:.2e})"
        )
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
    assert [g["token_ids"] for g in res["greedy_a"]] != [r[0] for r in refs["b"]], (
        "a and b must differ"
    )
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
        assert len({tuple(c["token_ids"]) for c in per_prompt}) > 1, (
            "the 4 samples of a prompt should differ"
        )
        for c in per_prompt:
            assert 0 < len(c["token_ids"]) <= MAX_TOKENS and len(c["logprobs"]) == len(
                c["token_ids"]
            )
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
        assert (got["token_ids"], got["finish_reason"]) == (
            want["token_ids"],
            want["finish_reason"],
        )
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
    assert (
        step["cut_before_abort"] == []
        and step["aborted_ids"] == ["cut"]
        and step["abort_again"] == []
    )
    partial, resumed = step["partial"], step["resumed"]
    assert 0 < len(partial["token_ids"]) < MAX_TOKENS and len(partial["logprobs"]) == len(
        partial["token_ids"]
    )
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
    assert step["errors"] == {
        "duplicate": "ValueError",
        "update_weights": "RuntimeError",
        "generate": "RuntimeError",
        "sleep": "RuntimeError",
    }
    assert step["version_after_refused_update"] == 3
    assert step["dup_aborted"] == ["dup"]


# -- the speed options (enforce_eager, seeded_sampling, engine_process) ------------------------------------------


def test_auto_is_eager_seeded_one_process_on_cpu_and_the_opposite_on_gpu():
    assert resolve_vllm_choices(on_cpu=True) == VllmChoices(
        enforce_eager=True, seeded_sampling=True, separate_process=False
    )
    assert resolve_vllm_choices(on_cpu=False) == VllmChoices(
        enforce_eager=False, seeded_sampling=False, separate_process=True
    )
    forced = resolve_vllm_choices(
        on_cpu=False, enforce_eager=True, seeded_sampling=True, engine_process="same"
    )
    assert forced == VllmChoices(enforce_eager=True, seeded_sampling=True, separate_process=False)


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "enforce_eager",
            "yes",
            r"roles\.generate\.options\.enforce_eager: 'yes' is not one of \['auto', True, False\]",
        ),
        (
            "seeded_sampling",
            1,
            r"roles\.generate\.options: seeded_sampling: true, false or 'auto', got 1$",
        ),
        (
            "engine_process",
            "other",
            r"roles\.generate\.options\.engine_process: 'other' is not one of "
            r"\['auto', 'same', 'separate'\]",
        ),
    ],
)
def test_a_wrong_value_names_the_dotted_key(key, value, message):
    from rollhpc.workers.vllm_generate import VllmGenerateWorker

    with pytest.raises(ConfigError, match=message):
        from_dict(
            VllmGenerateWorker.Options, {"model_dir": "m", key: value}, "roles.generate.options"
        )


@pytest.mark.parametrize(
    "key, value",
    [("enforce_eager", False), ("engine_process", "separate"), ("seeded_sampling", False)],
)
def test_the_torch_engine_refuses_the_vllm_speed_options(key, value):
    from rollhpc.workers.vllm_generate import VllmGenerateWorker

    with pytest.raises(
        ConfigError,
        match=rf"roles\.generate\.options: {key}={value!r} is a vLLM option"
        if key != "seeded_sampling"
        else r"roles\.generate\.options: seeded_sampling=false is a vLLM",
    ):
        from_dict(
            VllmGenerateWorker.Options,
            {"model_dir": "m", "engine": "torch", key: value},
            "roles.generate.options",
        )
    # what the torch engine does anyway is accepted
    from_dict(
        VllmGenerateWorker.Options,
        {"model_dir": "m", "engine": "torch", "seeded_sampling": True},
        "roles.generate.options",
    )


def test_set_values_load_and_the_judge_has_them_too():
    from rollhpc.workers.judge import JudgeWorker
    from rollhpc.workers.vllm_generate import VllmGenerateWorker

    opts = from_dict(
        VllmGenerateWorker.Options,
        {
            "model_dir": "m",
            "enforce_eager": False,
            "seeded_sampling": True,
            "engine_process": "separate",
        },
        "roles.generate.options",
    )
    assert (opts.enforce_eager, opts.seeded_sampling, opts.engine_process) == (
        False,
        True,
        "separate",
    )
    # its in-process judge engine is built by build_engine
    assert issubclass(JudgeWorker.Options, EngineConfig)
    with pytest.raises(ValueError, match="engine_process: 'auto', 'same' or 'separate'"):
        EngineConfig(engine_process="elsewhere")  # built in Python, not loaded: still checked


def test_engine_defaults_on_cpu_reach_vllm(probe):
    """The CPU's "auto": eager (vLLM's compilation off), seeded (test_sampling_n_and_seed), engine core in this
    process (vLLM's in-process client) with live-tensor weight updates (no weight-transfer backend at TP 1)."""
    assert probe[0]["engine_config"] == {
        "enforce_eager": True,
        "compilation_mode": "NONE",
        "engine_core_client": "InprocClient",
        "weight_transfer": None,
        "choices": {"enforce_eager": True, "seeded_sampling": True, "separate_process": False},
    }


def test_gpu_defaults_forced_on_cpu_reach_vllm(separate_probe):
    """Not eager: vLLM compiles (on CPU dynamo traces once; on GPU it would also capture CUDA graphs); the engine
    core behind vLLM's multiprocess client; weight updates by rollhpc's shared-memory weight transfer."""
    assert separate_probe[0]["engine_config"] == {
        "enforce_eager": False,
        "compilation_mode": "DYNAMO_TRACE_ONCE",
        "engine_core_client": "SyncMPClient",
        "weight_transfer": "rollhpc_shm",
        "choices": {"enforce_eager": False, "seeded_sampling": False, "separate_process": True},
    }


def test_a_separate_compiled_engine_generates_aborts_and_takes_new_weights(separate_probe):
    res, refs = separate_probe
    assert_matches(res["greedy_a"], refs["a"])
    partial = res["partial"]
    assert partial["finish_reason"] == "abort" and 0 < len(partial["token_ids"]) < MAX_TOKENS
    assert partial["token_ids"] == refs["a"][0][0][: len(partial["token_ids"])]
    # the weight-transfer protocol into the other process
    assert_matches(res["greedy_b"], refs["b"])
    assert_matches(res["greedy_b_after_wake"], refs["b"][:1])


def test_unseeded_sampling_drops_the_seeds(separate_probe):
    """seeded_sampling=false: the same seed twice samples from the engine's stream, so the calls differ (with
    seeds they are equal: test_sampling_n_and_seed)."""
    res, _ = separate_probe
    assert res["sample_seed7"] != res["sample_seed7_again"]


def test_a_separate_engine_core_unpickles_only_where_its_messages_need(monkeypatch):
    """The CUDA-IPC handles (GPU default) and a CPU MoE's repack function reach a separate engine core only through
    pickle; the engine then sets VLLM_ALLOW_INSECURE_SERIALIZATION=1 itself, or refuses at start where the user
    set it to 0. The shared-memory transfer and an engine core in this process need nothing."""
    from rollhpc.engines.vllm_startup import engine_core_takes_pickles as _engine_core_takes_pickles
    from rollhpc.engines.vllm_startup import let_engine_core_unpickle as _let_engine_core_unpickle

    assert "CUDA-IPC" in _engine_core_takes_pickles(True, "ipc", cpu_moe=False)
    assert "MoE" in _engine_core_takes_pickles(True, "rollhpc_shm", cpu_moe=True)
    assert _engine_core_takes_pickles(True, "rollhpc_shm", cpu_moe=False) is None
    assert _engine_core_takes_pickles(False, "ipc", cpu_moe=True) is None
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    _let_engine_core_unpickle("why")
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    with pytest.raises(
        ValueError, match="engine_process=separate sends the engine core why, which vLLM pickles"
    ):
        _let_engine_core_unpickle("why")


def test_vllms_encoder_takes_ipc_handle_arguments_only_with_the_flag(monkeypatch):
    """Why the flag: the kinds of objects in torch's CUDA rebuild arguments (a storage class, a dtype, a device),
    which the IPC weight transfer sends the engine core, fail vLLM's msgpack encoder without it and round-trip
    with it (the engine core's decoder reads the same variable)."""
    import torch
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    handle_like = {
        "GPU-uuid": (
            torch.UntypedStorage,
            torch.Size([4, 2]),
            torch.bfloat16,
            torch.device("cuda", 0),
            b"\x00handle",
            4096,
        )
    }
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        MsgpackEncoder().encode(handle_like)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    back = MsgpackDecoder().decode(MsgpackEncoder().encode(handle_like))
    assert back["GPU-uuid"][0] is torch.UntypedStorage and back["GPU-uuid"][2:] == [
        torch.bfloat16,
        torch.device("cuda", 0),
        b"\x00handle",
        4096,
    ]
