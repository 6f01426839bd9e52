"""The rollout scheduler's multi-turn life cycle: reset -> [generate -> env step]* -> judge group.

Real env role (``rollhpc.workers.env.EnvWorker``, its episode processes, a real tokenizer) over FrozenLake
and the misbehaving test environments; the generators are scripted ports that answer with fixed actions (the
engine path is covered by tests/world/test_rollout_scheduler.py and the agentic pipeline run), so which action an
episode takes, and when a request never finishes, are set by the test.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rollhpc.pipelines.agentic import SeedStream
from rollhpc.rollout.ports import Done, GenerationReply
from rollhpc.rollout.scheduler import RolloutScheduler
from rollhpc.rollout.scheduler_config import SchedulerConfig
from rollhpc.rollout.episode import episode_of
from rollhpc.rollout.rows import trajectory_row
from rollhpc.workers.env import EnvWorker
from tests.support.experiments import build_env_worker
from tests.support.envs import MixedEnv


@pytest.fixture(scope="module")
def tokenizer_dir(env_tokenizer_dir):
    return env_tokenizer_dir


@pytest.fixture(scope="module")
def tok(env_tok):
    return env_tok


def env_worker(tokenizer_dir, tmp_path, env: str, **options) -> EnvWorker:
    return build_env_worker(
        tmp_path,
        env=env,
        model_dir=str(tokenizer_dir),
        step_timeout_s=0.5,
        reset_timeout_s=5.0,
        workers=2,
        **options,
    )


class EnvPort:
    def __init__(self, worker: EnvWorker):
        self.w = worker

    def reset(self, items):
        return Done(self.w.reset(items))

    def step(self, items):
        return Done(self.w.step(items))

    def close(self, ids):
        return Done(self.w.close_episodes(ids))


class ScriptedGenerator:
    """Answers every request at its next call with one of ``actions`` (token ids, EOS included), picked by
    the request's sampling seed; requests whose id matches ``hang`` never finish. Records who asked."""

    def __init__(self, actions: list[list[int]], hang: str | None = None):
        self.actions, self.hang = actions, hang
        self.pending: dict[str, dict] = {}
        self.seen: list[str] = []

    def submit(self, adds, aborts):
        aborted = [(rid, comp([])) for rid in aborts if self.pending.pop(rid, None) is not None]
        for r in adds:
            self.pending[r.id] = r
            self.seen.append(r.id)
        finished = []
        for rid, r in list(self.pending.items()):
            if self.hang and self.hang in rid:
                continue
            action = self.actions[r.seed % len(self.actions)]
            cut = len(action) > r.max_tokens
            finished.append((rid, comp(action[: r.max_tokens], "length" if cut else "stop")))
            del self.pending[rid]
        return Done(GenerationReply(finished, aborted, 0.0))


def comp(ids: list[int], finish: str = "stop") -> SimpleNamespace:
    return SimpleNamespace(
        token_ids=list(ids), logprobs=[-0.5] * len(ids), finish_reason=finish, version=0
    )


def test_episodes_alternate_turns_stick_to_one_generator_and_become_rows(
    tokenizer_dir, tmp_path, tok
):
    worker = env_worker(tokenizer_dir, tmp_path, "frozenlake", env_options={"size": 4})
    try:
        # the last one runs past max_tokens=4: cut, it is a turn that did not end
        actions = [
            tok.encode(f" {a}") + [tok.eos_token_id]
            for a in ("right", "down", "left", "up", "up up up up")
        ]
        gens = [ScriptedGenerator(actions), ScriptedGenerator(actions)]
        sched = RolloutScheduler(
            gens,
            None,
            SchedulerConfig(
                group_size=3,
                redundancy=1,
                max_tokens=4,
                max_model_len=200,
                dynamic_sampling=False,
                oversample=0.0,
            ),
            seed=5,
            envs=[EnvPort(worker)],
        )
        groups, stats = sched.collect(SeedStream(7, 1000), 2, version=0)
        assert [len(g) for g in groups] == [3, 3]
        cut = 0
        assert (
            stats.episodes_started == 8
            and stats.samples_aborted_redundant == 2
            and stats.episodes_failed == 0
        )
        for g in groups:
            assert len({s.prompt.example.seed for s in g}) == 1  # a group shares its reset seed
            for s in g:
                ep = s.episode
                assert (
                    ep.finish in ("terminated", "truncated", "row_full") and len(ep.turn_ends) >= 1
                )
                assert len(ep.generated) == len(s.response) == len(s.logprobs)
                assert all(ep.generated[i] == 1 for i in ep.turn_ends)
                assert s.reward == ep.episode_return == sum(ep.turn_rewards)
                assert ep.turns_cut == sum(s.response[e] != tok.eos_token_id for e in ep.turn_ends)
                cut += ep.turns_cut
                # every turn of an episode was served by the generator of its first turn
                rid = f"{s.prompt.uid}.{s.index}."
                served = {
                    i for i, gen in enumerate(gens) if any(x.startswith(rid) for x in gen.seen)
                }
                assert served == {ep.generator}
                # the row is the prompt and the response as generated, up to the last turn (an observation
                # after it, one that filled the context, is no training input): nothing re-encoded
                row = trajectory_row(episode_of(s))
                end = ep.turn_ends[-1] + 1
                assert (
                    list(row.tokens) == ep.prompt_ids + s.response[:end] and len(row.tokens) <= 200
                )
                mask = np.zeros(len(row.tokens) - 1)
                mask[len(ep.prompt_ids) - 1 :] = ep.generated[:end]
                assert np.array_equal(row.loss_mask, mask)
                assert [
                    row.token_rewards[len(ep.prompt_ids) - 1 + e] for e in ep.turn_ends
                ] == ep.turn_rewards
                observed = tok.decode([t for t, m in zip(s.response, ep.generated) if m == 0])
                # observation tokens are the env's map text
                assert all(ch in "P.HG\n>" for ch in observed)
        assert cut > 0
        # finished, aborted and cut episodes all closed
        assert worker.metrics()["env_episodes_live"] == 0
    finally:
        worker.close()


def test_faulty_episodes_end_alone_and_a_stuck_request_is_abandoned(tokenizer_dir, tmp_path, tok):
    worker = env_worker(tokenizer_dir, tmp_path, "tests.support.envs:MixedEnv")
    try:
        go = [tok.encode(" go") + [tok.eos_token_id]]
        bad = {MixedEnv.seed_for(kind) for kind in ("raise", "hang", "garbage")}

        class Seeds:  # groups 0-2 misbehave, 3-5 are fine
            def __init__(self):
                self.seeds = sorted(bad) + [MixedEnv.seed_for("count", i) for i in range(3)]
                self.uid = 0

            def __iter__(self):
                return self

            def __next__(self):
                from rollhpc.rollout.types import EpisodeSeed
                from rollhpc.rollout.types import Prompt

                if self.uid >= len(self.seeds):
                    raise StopIteration
                self.uid += 1
                return Prompt(self.uid - 1, (), EpisodeSeed(self.seeds[self.uid - 1]))

        gen = ScriptedGenerator(go, hang="4.0.")  # group 4's first episode never gets an answer
        sched = RolloutScheduler(
            [gen],
            None,
            SchedulerConfig(
                group_size=2,
                max_tokens=4,
                dynamic_sampling=False,
                oversample=3.0,
                abandon_after_s=1.5,
            ),
            seed=0,
            envs=[EnvPort(worker)],
        )
        groups, stats = sched.collect(Seeds(), 6, version=0)
        by_uid = {g[0].prompt.uid: g for g in groups}
        assert (
            stats.episodes_failed == 6
            and stats.episodes_abandoned == 1
            and stats.groups_dropped_abandoned == 1
        )
        assert set(stats.failure_reasons) == {"error", "timeout", "invalid"}
        # the faulty groups are there, failed; group 4 was dropped
        assert sorted(by_uid) == [
            0,
            1,
            2,
            3,
            5,
        ]
        for uid in (0, 1, 2):
            assert all(
                s.episode.finish.split(":")[0] in ("error", "timeout", "invalid")
                for s in by_uid[uid]
            )
        assert all(s.episode.success and s.reward == 3.0 for uid in (3, 5) for s in by_uid[uid])
        assert worker.metrics()["env_episodes_live"] == 0
    finally:
        worker.close()
