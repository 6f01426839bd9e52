"""The agentic warm start (rollhpc.warm_start.agentic_prep): expert rows are exactly rollout's concatenation of
token ids, batched greedy play builds the same rows, a short SFT run writes a report with held-out success
rates, the directory is reused for the same settings and refused for others, and the settings hash follows
every setting."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # everything must come from the written directory

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollhpc.envs import make_env
from rollhpc.envs.base import HELDOUT_SEED_BASE
from rollhpc.envs.episodes import run_episodes
from rollhpc.rollout.episode import Episode
from rollhpc.rollout.turns import PlainTextTurns
from rollhpc.warm_start.agentic_episodes import (
    ACTION_PREFIX,
    clean_success,
    episode_examples,
    episode_texts,
    expert_episode,
)
from rollhpc.warm_start.agentic_play import play_episodes
from rollhpc.warm_start.agentic_prep import agentic_settings, prepare_agentic_policy
from rollhpc.warm_start.policy_prep import read_report, settings_hash
from rollhpc.warm_start.sft import SftConfig, train_sft_ids
from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer
import rollhpc.warm_start.agentic_build as prep

ENV, ENV_OPTIONS = "frozenlake", {"size": 4, "is_slippery": False}
SPEC = TinyModelConfig(
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    max_position_embeddings=256,
)
SFT = SftConfig(
    steps=30,
    batch_size=16,
    lr=3e-3,
    warmup=5,
    eval_examples=6,
    max_new_tokens=4,
    target_accuracy=None,
)


def prepare(out_dir: Path, sft: SftConfig = SFT, **kw) -> Path:
    args = dict(
        env=ENV,
        env_options=ENV_OPTIONS,
        spec=SPEC,
        sft=sft,
        seed=1,
        vocab_size=300,
        episodes=40,
        train_seeds=1000,
        progress=False,
    )
    return prepare_agentic_policy(out_dir, **{**args, **kw})


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Iterator[Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared
    yield prepare(tmp_path_factory.mktemp("agentic") / "policy")
    torch.set_num_threads(threads)


def expert_episodes(seeds: range) -> list[Episode]:
    env = make_env(ENV, ENV_OPTIONS)
    try:
        return [expert_episode(env, s) for s in seeds]
    finally:
        env.close()


def test_expert_rows_are_the_turn_by_turn_concatenation_of_ids():
    episodes = expert_episodes(range(8))
    turns = PlainTextTurns()
    tok = build_tokenizer((t for ep in episodes for t in episode_texts(ep, turns)), 300)
    ep = max(episodes, key=lambda e: len(e.actions))
    assert ep.success and len(ep.actions) >= 2 and len(ep.observations) == len(ep.actions) + 1
    row, examples = episode_examples(ep, tok)

    def ids(text: str, special: bool = False) -> list[int]:
        return tok(text, add_special_tokens=special)["input_ids"]

    # the env role's prompt (plain turns: special tokens on), then per turn " action" + EOS, then the next obs
    expected = ids(turns.first(ep.instruction, ep.observations[0]), special=True)
    assert len(examples) == len(ep.actions)
    for k, action in enumerate(ep.actions):
        prompt, completion = examples[k]
        assert prompt == expected and completion == ids(" " + action) + [tok.eos_token_id]
        expected = expected + completion
        if k + 1 < len(ep.actions):
            expected = expected + ids(turns.next(ep.observations[k + 1]))
    assert row == expected
    # the completion is what the policy writes: a space, the action, EOS; the env gets the stripped action
    assert ACTION_PREFIX == " " and tok.decode(examples[0][1]) == f" {ep.actions[0]}{tok.eos_token}"
    assert turns.action(tok.decode(examples[0][1], skip_special_tokens=True)) == ep.actions[0]
    # the row reads as the transcript (nothing lost or added at the boundaries)
    text = turns.first(ep.instruction, ep.observations[0]) + "".join(
        f" {a}{tok.eos_token}" + (turns.next(o) if k + 1 < len(ep.actions) else "")
        for k, (a, o) in enumerate(zip(ep.actions, ep.observations[1:]))
    )
    assert tok.decode(row) == text


class ExpertModel:
    """Stands in for a model in ``play_episodes``: its logits pick the expert's next token for the row it has
    been fed so far (rebuilt from the unmasked tokens of each chunk), so the batched, cached, left-padded turn
    loop is checked without training anything."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int):
        self.answers, self.vocab = answers, vocab
        self.config = SimpleNamespace(max_position_embeddings=256)
        self.batches: list[int] = []  # batch size of each prefill (a new cache)
        self.fed: list[list[int]] = []

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values, use_cache):
        if past_key_values is None:
            self.batches.append(len(input_ids))
            self.fed = [[] for _ in input_ids]
        chunk_mask = attention_mask[:, -input_ids.shape[1] :]
        logits = torch.zeros(len(input_ids), input_ids.shape[1], self.vocab)
        for b, (ids, m, pos) in enumerate(zip(input_ids, chunk_mask, position_ids)):
            real = ids[m.bool()].tolist()
            assert pos[m.bool()].tolist() == list(
                range(len(self.fed[b]), len(self.fed[b]) + len(real))
            )
            self.fed[b] += real
            row = self.fed[b]
            # the turn being written: the longest prompt that starts the row
            for cut in range(len(row), -1, -1):
                answer = self.answers.get(tuple(row[:cut]))
                if answer is not None and len(row) - cut < len(answer):
                    logits[b, -1, answer[len(row) - cut]] = 1.0
                    break
        return SimpleNamespace(logits=logits, past_key_values=object())


def test_batched_greedy_play_builds_the_expert_rows_and_counts_success():
    episodes = expert_episodes(range(100, 110))
    tok = build_tokenizer((t for ep in episodes for t in episode_texts(ep, PlainTextTurns())), 300)
    answers, rows = {}, {}
    for ep in episodes:
        rows[ep.seed], examples = episode_examples(ep, tok)
        answers.update({tuple(p): c for p, c in examples})
    model = ExpertModel(answers, len(tok))
    played = play_episodes(
        model, tok, ENV, ENV_OPTIONS, range(100, 110), max_new_tokens=8, batch_size=4
    )
    assert [p.seed for p in played] == list(range(100, 110)) and all(p.success for p in played)
    assert [len(p.turns) for p in played] == [len(ep.actions) for ep in episodes]
    # the final row holds the last turn's ids and no observation after it: the expert row exactly
    assert [p.length for p in played] == [len(rows[ep.seed]) for ep in episodes]
    assert model.batches == [4, 4, 2]  # open episodes share forward passes, batch_size at a time
    # a turn cut by its budget has no EOS: counted, and with end_unstopped the episode ends there
    cut = play_episodes(
        model, tok, ENV, ENV_OPTIONS, [100, 101], max_new_tokens=1, end_unstopped=True
    )
    assert [(len(p.turns), p.turns_cut, p.truncated, clean_success(p)) for p in cut] == [
        (1, 1, True, False)
    ] * 2


def test_short_sft_run_reports_heldout_success_and_is_reused(policy, monkeypatch):
    # no temp dir left beside it
    assert sorted(p.name for p in policy.parent.iterdir()) == ["policy"]
    model, tok = AutoModelForCausalLM.from_pretrained(policy), AutoTokenizer.from_pretrained(policy)
    assert model.config.max_position_embeddings == 256 and tok.eos_token_id == 0
    report = read_report(policy)
    assert report["settings"]["env"] == ENV and report["settings"]["env_options"] == ENV_OPTIONS
    assert (
        report["steps"] == 30
        and not report["reached_target"]
        and report["loss_final"] < report["loss_first"]
    )
    assert report["heldout_seeds"] == {"first": HELDOUT_SEED_BASE, "count": 6}
    for key in ("heldout_success_rate", "train_success_rate", "expert_success_rate"):
        assert 0.0 <= report[key] <= 1.0
    # non-slippery: BFS solves
    assert report["expert_success_rate"] == report["expert_train_success_rate"] == 1.0
    assert report["expert_turns_mean"] > 1 and report["heldout_turns_mean"] >= 1
    assert report["row_tokens_max"] <= 256 and report["turn_examples"] > 40
    # the saved weights are the evaluated ones; sampled play is seeded and leaves the caller's RNG alone
    heldout = [HELDOUT_SEED_BASE + i for i in range(6)]
    played = play_episodes(model, tok, ENV, ENV_OPTIONS, heldout, max_new_tokens=4)
    assert sum(p.success for p in played) / 6 == report["heldout_success_rate"]
    # the cached, batched player plays exactly as generate() does episode by episode (rollhpc env's ModelPolicy)
    alone = run_episodes(
        ENV, ENV_OPTIONS, str(policy), 6, seed0=HELDOUT_SEED_BASE, max_new_tokens=4
    ).played
    assert [(t.success, len(t.turns), t.length) for t in alone] == [
        (p.success, len(p.turns), p.length) for p in played
    ]
    rng = torch.get_rng_state()
    sampled = play_episodes(
        model, tok, ENV, ENV_OPTIONS, heldout, max_new_tokens=4, temperature=1.0, sample_seed=1
    )
    assert torch.equal(torch.get_rng_state(), rng)
    assert sum(p.success for p in sampled) / 6 == report["heldout_sampled_success_rate"]
    # same settings: reused untouched, without training
    monkeypatch.setattr(prep, "train_sft_ids", lambda *a, **k: pytest.fail("retrained"))
    before = (policy / "model.safetensors").stat().st_mtime_ns
    assert prepare(policy) == policy and (policy / "model.safetensors").stat().st_mtime_ns == before
    # other settings: refused, naming what differs
    with pytest.raises(FileExistsError, match=r"differing: episodes"):
        prepare(policy, episodes=41)
    with pytest.raises(FileExistsError, match=r"differing: env_options.size"):
        prepare(policy, env_options={"size": 5, "is_slippery": False})


def test_settings_hash_follows_every_setting():
    base = dict(
        env=ENV,
        env_options=ENV_OPTIONS,
        spec=SPEC,
        sft=SFT,
        seed=1,
        vocab_size=300,
        episodes=40,
        train_seeds=1000,
    )
    key = settings_hash(agentic_settings(**base))
    assert (
        settings_hash(
            agentic_settings(**{**base, "env_options": dict(reversed(ENV_OPTIONS.items()))})
        )
        == key
    )
    for change in (
        {"env": "sokoban"},
        {"env_options": {**ENV_OPTIONS, "size": 5}},
        {"spec": replace(SPEC, hidden_size=128)},
        {"sft": replace(SFT, target_accuracy=0.2)},
        {"sft": replace(SFT, lr=1e-3)},
        {"seed": 2},
        {"vocab_size": 400},
        {"episodes": 41},
        {"train_seeds": 999},
        {"stop_on": "greedy"},
    ):
        assert settings_hash(agentic_settings(**{**base, **change})) != key, change
    # JSON as recorded
    assert json.loads(json.dumps(agentic_settings(**base))) == agentic_settings(**base)
    with pytest.raises(ValueError, match="stop_on must be 'sampled' or 'greedy'"):
        agentic_settings(**base, stop_on="argmax")


def test_rows_longer_than_the_context_and_bad_counts_are_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"row of \d+ tokens but spec.max_position_embeddings is 16"
    ):
        prepare(tmp_path / "p", spec=replace(SPEC, max_position_embeddings=16), episodes=8)
    with pytest.raises(ValueError, match="40 expert episodes need as many distinct training seeds"):
        prepare(tmp_path / "p", train_seeds=10)
    with pytest.raises(ValueError, match="does not take options"):
        prepare(tmp_path / "p", env_options={"sise": 4})
    assert not (tmp_path / "p").exists() and list(tmp_path.iterdir()) == []


def test_training_stops_when_the_monitor_reaches_the_target(policy):
    model, tok = AutoModelForCausalLM.from_pretrained(policy), AutoTokenizer.from_pretrained(policy)
    _, examples = episode_examples(
        max(expert_episodes(range(4)), key=lambda e: len(e.actions)), tok
    )
    values = iter([0.0, 0.1, 0.5, 0.9])
    seen_training: list[bool] = []

    def monitor(m) -> float:
        seen_training.append(m.training)
        return next(values)

    options = replace(SFT, steps=50, batch_size=2, check_every=2, target_accuracy=0.3)
    result = train_sft_ids(
        model, examples, options, pad_id=tok.pad_token_id, monitor=monitor, progress=False
    )
    assert (
        result.reached_target
        and result.steps == 6
        and result.accuracy_curve == [(2, 0.0), (4, 0.1), (6, 0.5)]
    )
    assert seen_training == [False, False, False]
    with pytest.raises(ValueError, match="target_accuracy needs a monitor"):
        train_sft_ids(model, examples, options, pad_id=tok.pad_token_id, progress=False)


def test_the_early_stop_plays_sampled_episodes_on_training_seeds(tmp_path, monkeypatch):
    calls = []
    real_play = prep.play_episodes

    def recording_play(model, tokenizer, env, env_options, seeds, **kw):
        calls.append((list(seeds), kw["temperature"]))
        return real_play(model, tokenizer, env, env_options, seeds, **kw)

    monkeypatch.setattr(prep, "play_episodes", recording_play)
    # the first check meets any target
    monkeypatch.setattr(prep, "_clean_success_rate", lambda episodes: 1.0)
    out = prepare(tmp_path / "p", sft=replace(SFT, target_accuracy=0.5, check_every=5), episodes=20)
    report = read_report(out)
    assert (
        report["reached_target"]
        and report["steps"] == 5
        and report["settings"]["stop_on"] == "sampled"
    )
    # the monitor: 6 training seeds (monitor_episodes <= eval_examples), sampled
    seeds, temperature = calls[0]
    assert temperature == 1.0 and len(seeds) == 6 and all(0 <= s < 1000 for s in seeds)
    # then the report's greedy held-out play
    assert calls[1] == (
        [HELDOUT_SEED_BASE + i for i in range(6)],
        0.0,
    )
