"""The env role (rollhpc.workers.env): episodes keyed by id, batched steps under a time limit, observations
tokenized on the rank, faults that end one episode and never the run, nothing left running at close.

The worker is built directly (no MPI: its methods are plain calls here) over a real tokenizer trained
offline, and the environments of ``tests/support/envs.py`` run in the role's real episode processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import psutil
import pytest

from rollhpc.rollout import turns as turn_formats
from rollhpc.rollout.turns import PlainTextTurns
from rollhpc.rollout.ports import ResetRequest, StepRequest
from rollhpc.workers.env import EnvWorker
from tests.support.experiments import build_env_worker
from tests.support.processes import REPO, cli_env
from tests.support.envs import MixedEnv

MIXED = "tests.support.envs:MixedEnv"
STEP_S = 0.5
PLAIN = PlainTextTurns()
seed = MixedEnv.seed_for
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(env_tokenizer_dir):
    return env_tokenizer_dir


@pytest.fixture(scope="module")
def tok(env_tok):
    return env_tok


@pytest.fixture
def make_worker(tokenizer_dir, tmp_path):
    built: list[EnvWorker] = []

    def make(env: str = MIXED, **options) -> EnvWorker:
        built.append(
            build_env_worker(
                tmp_path,
                env=env,
                model_dir=str(options.pop("model_dir", tokenizer_dir)),
                **{"step_timeout_s": STEP_S, "reset_timeout_s": 2.0, "workers": 4, **options},
            )
        )
        return built[-1]

    yield make
    for w in built:
        w.close()


def go(tok, *episodes: str, text: str = "go") -> list[StepRequest]:
    """A step item per episode whose response is ``text`` then EOS (skipped when decoding)."""
    return [StepRequest(e, tok.encode(text) + [tok.eos_token_id]) for e in episodes]


def descendants() -> list[psutil.Process]:
    """Running (not zombie) processes under this one."""
    return [p for p in psutil.Process().children(recursive=True) if running(p.pid)]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_options_are_checked(tokenizer_dir):
    ok = {"env": MIXED, "model_dir": str(tokenizer_dir)}
    for bad, match in [
        ({"env": "tests.support.envs:Nope"}, "no environment class"),
        ({"env": "no_such_env"}, "unknown environment"),
        ({"turns": "fancy"}, "turns must be"),
        ({"system": "Be brief."}, "needs turns: chat"),
        ({"eos_token": "<|im_end|>"}, "needs turns: chat"),
        ({"step_timeout_s": 0}, "step_timeout_s"),
        ({"reset_timeout_s": float("inf")}, "reset_timeout_s"),
        ({"workers": 0}, "workers"),
        ({"env_options": ["max_steps", 3]}, "env_options"),
    ]:
        with pytest.raises(ValueError, match=match):
            EnvWorker.Options(**{**ok, **bad})


def test_good_episodes_step_and_are_tokenized_on_the_rank(make_worker, tok):
    w = make_worker()
    replies = w.reset([ResetRequest("a", seed("count", 0)), ResetRequest("b", seed("count", 1))])
    assert [r.ended for r in replies] == [None, None]
    assert replies[0].prompt_ids == tok.encode(PLAIN.first("Say go.", "count 0"))
    assert replies[1].prompt_ids == tok.encode(PLAIN.first("Say go.", "count 1"))
    assert replies[0].state_key == ("count", 0) and replies[0].rank == 0
    assert replies[0].instruction == "Say go." and replies[0].info["state_key"] == ("count", 0)

    for n in (1, 2):
        a, b = w.step(go(tok, "a") + go(tok, "b", text=" stop "))
        assert a.obs_ids == tok.encode(PLAIN.next(f"you said 'go' at step {n}"))
        # the action is stripped
        assert b.obs_ids == tok.encode(PLAIN.next(f"you said 'stop' at step {n}"))
        assert (a.reward, b.reward) == (1.0, 0.0)
        assert a.ended is None and a.success is None and not a.terminated and not a.truncated
        assert a.state_key == ("count", n) and b.metrics == {"chars": 4.0}
        assert a.use_tool == (n == 2) and a.step_s > 0
    a, b = w.step(go(tok, "a") + go(tok, "b", text="stop"))
    assert a.ended == b.ended == "terminated" and a.terminated and a.obs_ids == []
    assert (a.success, b.success) == (True, False)

    # an ended episode is gone: stepping it is a caller bug
    with pytest.raises(ValueError, match="not held"):
        w.step(go(tok, "a"))
    m = w.metrics()
    counts = (
        m["env_episodes_started"],
        m["env_ended_terminated"],
        m["env_steps"],
        m["env_episodes_live"],
    )
    assert counts == (2, 2, 6, 0)
    assert (
        m["env_step_s_mean"] > 0 and m["env_timeouts"] == m["env_errors"] == m["env_invalid"] == 0
    )


def test_faulty_envs_end_only_their_episode_within_the_time_limit(make_worker, tok):
    children_before = {p.pid for p in descendants()}
    w = make_worker()
    seeds = {
        "hang": seed("hang"),
        "regex": seed("regex"),
        "raise": seed("raise"),
        "crash": seed("crash"),
        **{f"garbage{k}": seed("garbage", k) for k in range(7)},  # k: which kind of garbage
        "good0": seed("count", 0),
        "good1": seed("count", 1),
    }
    ids = list(seeds)
    replies = w.reset([ResetRequest(e, s) for e, s in seeds.items()])
    assert all(r.ended is None for r in replies)

    t0 = time.perf_counter()
    replies = {r.episode: r for r in w.step(go(tok, *ids))}
    took = time.perf_counter() - t0
    assert took < STEP_S + 1.0, f"a batch with hung envs took {took:.2f} s (limit {STEP_S} s)"

    assert replies["hang"].ended == "timeout"
    # hung in C code holding the GIL: killed all the same
    assert replies["regex"].ended == "timeout"
    # first line only
    assert replies["raise"].ended == "error: RuntimeError: board exploded at step 1"
    assert replies["crash"].ended == "error: the environment process died"
    invalid = [replies[f"garbage{k}"].ended for k in range(7)]
    assert invalid == [
        "invalid: step returned a 3-tuple, not a 5-tuple (observation, reward, terminated, "
        "truncated, info)",
        "invalid: observation is int, not str",
        "invalid: reward nan is not a finite number",
        "invalid: terminated is str, not bool",
        "invalid: info is list, not dict",
        "invalid: info['state_key'] (list) is not hashable",
        "invalid: step returned NoneType, not a 5-tuple (observation, reward, terminated, "
        "truncated, info)",
    ]
    for e in ids[:-2]:
        r = replies[e]
        assert r.obs_ids == [] and r.reward == 0.0 and r.truncated and not r.terminated
    for e in ("good0", "good1"):
        assert replies[e].ended is None and replies[e].reward == 1.0
        assert replies[e].obs_ids == tok.encode(PLAIN.next("you said 'go' at step 1"))

    # The hung processes were killed, not abandoned: only the host and the two good episodes run, and the
    # next batch is not held up by anything of the last one.
    def ours() -> set[int]:
        return {p.pid for p in descendants()} - children_before

    deadline = time.monotonic() + 3.0
    while len(ours()) != 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ours()) == 3
    t0 = time.perf_counter()
    again = w.step(go(tok, "good0", "good1"))
    assert time.perf_counter() - t0 < STEP_S
    assert [r.ended for r in again] == [None, None]
    with pytest.raises(ValueError, match="not held"):
        w.step(go(tok, "hang"))

    m = w.metrics()
    assert (m["env_timeouts"], m["env_errors"], m["env_invalid"]) == (2, 2, 7)
    assert (m["env_episodes_started"], m["env_episodes_ended"], m["env_episodes_live"]) == (
        13,
        11,
        2,
    )
    assert m["env_steps"] == 4


def test_reset_faults_end_their_episode(make_worker, tok):
    w = make_worker(reset_timeout_s=1.0)
    t0 = time.perf_counter()
    replies = w.reset(
        [
            ResetRequest("ok", seed("count")),
            ResetRequest("bad", seed("reset_raise")),
            ResetRequest("stuck", seed("reset_hang")),
        ]
    )
    assert time.perf_counter() - t0 < 1.0 + 1.0
    assert [r.ended for r in replies] == [
        None,
        "error: ValueError: no level for seed 700",
        "timeout",
    ]
    assert replies[1].prompt_ids == [] and replies[0].prompt_ids
    assert w.step(go(tok, "ok"))[0].ended is None
    with pytest.raises(ValueError, match="already held"):
        w.reset([ResetRequest("ok", 1)])
    m = w.metrics()
    assert (m["env_errors"], m["env_timeouts"], m["env_episodes_live"]) == (1, 1, 1)


def test_steps_of_a_batch_run_in_parallel(make_worker, tok):
    w = make_worker(workers=4, step_timeout_s=5.0)
    ids = [f"s{k}" for k in range(4)]
    w.reset([ResetRequest(e, seed("slow", k)) for k, e in enumerate(ids)])
    t0 = time.perf_counter()
    assert all(r.ended is None for r in w.step(go(tok, *ids)))
    assert time.perf_counter() - t0 < 2.5 * 0.3  # four 0.3 s steps, overlapping


def test_close_closes_every_env_and_leaves_nothing_running(make_worker, tok, tmp_path):
    threads_before = {t for t in threading.enumerate() if not t.daemon}
    children_before = {p.pid for p in descendants()}
    w = make_worker(env_options={"marker_dir": str(tmp_path)})
    w.reset(
        [
            ResetRequest(e, seed(kind, k))
            for k, (e, kind) in enumerate(
                [("a", "count"), ("b", "count"), ("c", "count"), ("h", "hang")]
            )
        ]
    )
    assert [r.ended for r in w.step(go(tok, "a", "h"))] == [None, "timeout"]
    assert w.close_episodes(["b", "b", "never-seen"]) == 1
    assert w.close_episodes(["b"]) == 0  # idempotent
    assert w.metrics()["env_ended_closed"] == 1
    w.close()
    w.close()  # twice is fine

    assert {p.pid for p in descendants()} - children_before == set()
    assert {t for t in threading.enumerate() if not t.daemon} - threads_before == set()
    # Every env that answered was closed (a=0, b=1, c=2); the hung one was killed (no marker).
    assert sorted(p.name for p in tmp_path.glob("closed-*")) == ["closed-0", "closed-1", "closed-2"]


def test_a_lost_host_ends_its_episodes_and_is_started_again(make_worker, tok):
    w = make_worker()
    w.reset([ResetRequest("a", seed("count"))])
    (host,) = [
        p for p in psutil.Process().children() if "rollhpc.envs.host" in " ".join(p.cmdline())
    ]
    host.kill()  # as the OOM killer would: its episode processes die with it
    host.wait(5)
    assert w.step(go(tok, "a"))[0].ended == "error: the environment process died"
    (r,) = w.reset([ResetRequest("b", seed("count"))])
    assert r.ended is None and w.step(go(tok, "b"))[0].ended is None


KILLED_RANK = """
import json, sys, psutil
from rollhpc.rollout.ports import ResetRequest, StepRequest
from tests.support.experiments import build_env_worker
from tests.support.envs import MixedEnv

w = build_env_worker(sys.argv[2], env="tests.support.envs:MixedEnv", model_dir=sys.argv[1], step_timeout_s=60.0)
w.reset([ResetRequest("h", MixedEnv.seed_for("hang")), ResetRequest("a", MixedEnv.seed_for("count"))])
print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]), flush=True)
w.step([StepRequest("h", [])])  # hangs: the rank is killed while its env is stuck
"""


def test_a_killed_rank_leaves_no_env_process_behind(tokenizer_dir, tmp_path):
    rank = subprocess.Popen(
        [sys.executable, "-c", KILLED_RANK, str(tokenizer_dir), str(tmp_path)],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = json.loads(rank.stdout.readline())
        assert len(pids) == 3  # the host and two episode processes
        time.sleep(0.3)  # the hanging step is under way
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 5.0
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, "env processes outlived their rank"


def test_chat_turns_format_and_encode_on_the_rank(make_worker, tok, tokenizer_dir, tmp_path):
    chat_turns = getattr(turn_formats, "ChatTemplateTurns", None)
    if chat_turns is None:
        pytest.skip("rollhpc.rollout.turns.ChatTemplateTurns has not landed yet")
    from transformers import AutoTokenizer

    chat_tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    chat_tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat_tok.chat_template = CHATML
    chat_tok.save_pretrained(tmp_path / "chat")
    w = make_worker(
        model_dir=tmp_path / "chat", turns="chat", system="Be brief.", eos_token="<|im_end|>"
    )
    fmt = chat_turns(chat_tok, system="Be brief.", eos_token="<|im_end|>")
    w.reset([ResetRequest("a", seed("count", 0)), ResetRequest("b", seed("count", 1))])
    r = w.reset([ResetRequest("c", seed("count", 2))])[0]
    assert r.prompt_ids == chat_tok.encode(
        fmt.first("Say go.", "count 2"), add_special_tokens=False
    )
    im_end = chat_tok.convert_tokens_to_ids("<|im_end|>")
    # b ran out of budget
    stopped, cut = w.step(
        [
            StepRequest("a", chat_tok.encode("go") + [im_end]),
            StepRequest("b", chat_tok.encode("go")),
        ]
    )
    assert stopped.obs_ids == chat_tok.encode(
        fmt.next("you said 'go' at step 1", stopped=True), add_special_tokens=False
    )
    assert cut.obs_ids == chat_tok.encode(
        fmt.next("you said 'go' at step 1", stopped=False), add_special_tokens=False
    )
    # the turn is closed once either way
    assert cut.obs_ids[0] == im_end and stopped.obs_ids[0] != im_end
