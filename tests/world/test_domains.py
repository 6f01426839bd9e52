"""Multi-domain RLVR without a model: the scheduler scores each domain with its own roles, combines their
components with weights, applies each domain's dynamic sampling, and counts per domain; prompts come from the
domains by share; bad domain configs are refused at load. (tests/world/test_rlvr_pipeline.py runs a real world.)"""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from rollhpc.pipelines.domains import (
    DomainConfig,
    DomainNormalizers,
    MixedPromptStream,
    sample_metrics,
)
from rollhpc.rollout.ports import Done, GenerationReply
from rollhpc.rollout.scheduler import RolloutScheduler
from rollhpc.rollout.scheduler_config import SchedulerConfig
from rollhpc.rollout.scoring import DomainScoring, combine
from rollhpc.rollout.types import Prompt


class Engine:
    """Answers every request at once with the prompt's last token repeated (seeded by nothing)."""

    def submit(self, adds, aborts):
        done = [
            (
                a.id,
                SimpleNamespace(
                    token_ids=[a.prompt[-1], len(a.prompt) + int(a.id.split(".")[1])],
                    logprobs=[-0.1, -0.2],
                    finish_reason="stop",
                    version=0,
                ),
            )
            for a in adds
        ]
        return Done(
            GenerationReply(
                done,
                [
                    (
                        i,
                        SimpleNamespace(
                            token_ids=[], logprobs=[], finish_reason="abort", version=0
                        ),
                    )
                    for i in aborts
                ],
                0.0,
            )
        )


class Role:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def submit(self, items):
        self.calls += 1
        return Done([self.fn(ex, resp) for ex, resp in items])


def prompts(domains: list[str]):
    uid = 0
    while True:
        for d in domains:
            yield Prompt(uid, (1, 2, uid % 7), example=uid, domain=d)
            uid += 1


def test_each_domain_is_scored_by_its_roles_and_own_dynamic_sampling():
    rule = Role(lambda ex, resp: float(resp[1] % 2))  # one float: component "rule"
    judge = Role(lambda ex, resp: {"judge": 1.0, "format": -0.5})  # named components
    code = Role(lambda ex, resp: {"tests": 0.0, "format": 0.0})  # always uniform
    sched = RolloutScheduler(
        [Engine()],
        {
            "math": DomainScoring(
                {"rule": [rule], "judge": [judge]}, weights={"rule": 2.0, "format": 0.2}
            ),
            "code": DomainScoring({"code": [code]}, dynamic_sampling=False),
        },
        SchedulerConfig(group_size=4, max_tokens=2, dynamic_sampling=True),
        seed=0,
    )
    groups, stats = sched.collect(prompts(["math", "code"]), 6, version=0)
    assert len(groups) == 6
    by = Counter(g[0].prompt.domain for g in groups)
    assert by["code"] >= 1 and by["math"] >= 1
    for g in groups:
        for s in g:
            if s.prompt.domain == "math":
                assert s.components == {"rule": s.components["rule"], "judge": 1.0, "format": -0.5}
                assert s.reward == pytest.approx(2.0 * s.components["rule"] + 1.0 - 0.1)
            else:
                assert s.components == {"tests": 0.0, "format": 0.0} and s.reward == 0.0
        if g[0].prompt.domain == "math":  # dynamic sampling kept only groups with differing rewards
            assert len({s.reward for s in g}) > 1
    metrics = stats.as_metrics()
    assert metrics["code/groups_dropped_uniform"] == 0  # its own setting: uniform groups are kept
    assert metrics["math/groups_started"] + metrics["code/groups_started"] == stats.groups_started
    assert (
        metrics["math/tokens_generated"] + metrics["code/tokens_generated"]
        == stats.tokens_generated
    )
    assert rule.calls == judge.calls  # every math batch went to both roles
    m = sample_metrics([s for g in groups for s in g])
    assert (
        m["code/reward/tests"] == 0.0 and m["math/reward/judge"] == 1.0 and "math/reward_mean" in m
    )
    state = sched.state_dict()["next_reward"]
    assert state["math/rule"] == rule.calls and state["code/code"] == code.calls
    with pytest.raises(
        ValueError, match="weights name component.s. judge that no reward role returned"
    ):
        combine({"rule": 1.0}, {"judge": 1.0})


def test_an_unknown_domain_is_an_error_and_one_port_list_is_one_domain():
    sched = RolloutScheduler(
        [Engine()],
        [Role(lambda ex, resp: 1.0)],
        SchedulerConfig(group_size=2, max_tokens=2, dynamic_sampling=False),
    )
    groups, _ = sched.collect(prompts(["default"]), 2, version=0)
    assert [s.components for s in groups[0]] == [{"reward": 1.0}] * 2
    sched.scorer.load_state_dict(7)  # a checkpoint from before domains
    assert sched.scorer.turn == {"default/reward": 7}
    with pytest.raises(ValueError, match="domain 'code', which has no reward roles"):
        sched.collect(prompts(["code"]), 1, version=0)


def test_prompts_follow_the_shares_and_resume_where_they_stopped():
    examples = [
        SimpleNamespace(domain=d, prompt=f"{d} {i}", inner=(d, i))
        for d in ("a", "b")
        for i in range(5)
    ]
    stream = MixedPromptStream(examples, {"a": 0.8, "b": 0.2}, lambda ex: [len(ex.prompt)], seed=3)
    first = [next(stream) for _ in range(500)]
    share = sum(p.domain == "a" for p in first) / len(first)
    assert 0.74 < share < 0.86 and [p.uid for p in first] == list(range(500))
    assert all(p.example[0] == p.domain for p in first)
    state = stream.state_dict()
    after = [(p.domain, p.example) for p in (next(stream) for _ in range(20))]
    again = MixedPromptStream(examples, {"a": 0.8, "b": 0.2}, lambda ex: [len(ex.prompt)], seed=99)
    again.load_state_dict(state)
    assert [(p.domain, p.example) for p in (next(again) for _ in range(20))] == after
    with pytest.raises(ValueError, match="no training examples for domain"):
        MixedPromptStream(examples, {"a": 0.5, "c": 0.5}, len, seed=0)


def test_rewards_are_normalised_per_domain():
    from rollhpc.algo.reward_norm import RewardNormConfig

    def group(domain, rewards):
        return [SimpleNamespace(reward=r, prompt=SimpleNamespace(domain=domain)) for r in rewards]

    norms = DomainNormalizers(RewardNormConfig(kind="running"), ["a", "b"])
    rng = random.Random(0)
    for _ in range(20):
        out = norms(
            [
                group("a", [rng.random() for _ in range(4)]),
                group("b", [100 + 10 * rng.random() for _ in range(4)]),
            ]
        )
    assert abs(out[1].mean()) < 3 and abs(out[0].mean()) < 3  # each on its own scale
    assert set(norms.state_dict()) == {"a", "b"}


def test_the_mixture_task_keeps_each_domains_splits_and_shares():
    from rollhpc.tasks import mixture

    doms = {
        "add": {"task": "arithmetic", "options": {"digits": 2, "ops": ["+"]}, "share": 0.75},
        "count": {"task": "countdown", "share": 0.25},
    }
    train, heldout = mixture.make_splits(5, 40, 8, domains=doms)
    assert Counter(e.domain for e in train) == {"add": 30, "count": 10}
    assert Counter(e.domain for e in heldout) == {"add": 6, "count": 2}
    assert mixture.make_splits(5, 40, 8, domains=doms) == (train, heldout)
    ex = train[0]
    assert mixture.score(ex, mixture.completion(ex)) == 1.0 and ex.prompt == mixture.format_prompt(
        ex
    )
    assert len(list(mixture.corpus(train))) == 40
    with pytest.raises(ValueError, match="shares sum to 1.1"):
        mixture.make_splits(5, 40, 8, domains={**doms, "add": {**doms["add"], "share": 0.85}})


def multidomain_config(**domains) -> dict:
    import yaml

    from tests.support.processes import REPO

    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg["pipeline"]["options"].pop("task")
    cfg["pipeline"]["options"]["warm_start"] = None
    cfg["pipeline"]["options"]["domains"] = domains
    for role in cfg["roles"].values():
        role["options"]["model_dir"] = "/tmp"
    cfg["roles"]["reward"]["options"]["task"] = "arithmetic"
    return cfg


def test_bad_domain_configs_are_refused_at_load():
    from rollhpc.config import ConfigError, load

    add = {"task": "arithmetic", "share": 0.5}
    cfg = load(multidomain_config(a=add, b={**add, "rewards": ["reward"]}))
    assert isinstance(cfg.pipeline.options.domains["a"], DomainConfig)
    with pytest.raises(ConfigError, match="domains.b.rewards: no role named 'judge'"):
        load(multidomain_config(a=add, b={**add, "rewards": ["reward", "judge"]}))
    with pytest.raises(ConfigError, match="the shares sum to 0.9, not 1"):
        load(multidomain_config(a=add, b={**add, "share": 0.4}))
    with pytest.raises(ConfigError, match="unknown task 'nosuch'"):
        load(multidomain_config(a=add, b={**add, "task": "nosuch"}))
    bad = multidomain_config(a={**add, "share": 1.0})
    bad["pipeline"]["options"]["task"] = {"name": "countdown"}
    with pytest.raises(ConfigError, match="either task.name.task.options .one domain. or domains"):
        load(bad)


@pytest.mark.slow
def test_a_two_domain_run_scores_and_reports_each_domain_by_its_roles(
    tmp_path, tmp_path_factory, tiny_model
):
    """A real world (Megatron trainer, the torch engine's generator, two rule reward roles and a judge with a vLLM
    engine of its own): additions scored by `reward`; countdown by `reward_count` plus the judge's verdict at weight 0.5;
    metrics, held-out accuracy and the rollouts file per domain; the judge's counters in the metrics; the plan
    lists every reward role."""
    import json

    import h5py
    import yaml

    from tests.support.processes import REPO, assert_no_orphans, rollhpc
    from tests.support.judge_models import TEMPLATE, yes_judge

    judge = yes_judge(tmp_path_factory.getbasetemp(), tiny_model)
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    o = cfg["pipeline"]["options"]
    o.update(
        model_dir=str(tiny_model),
        warm_start=None,
        task={"n_train": 1000, "n_heldout": 40},
        steps=3,
        eval_every=3,
        prompts_per_step=4,
    )
    o["rollout"]["dynamic_sampling"] = False
    o["domains"] = {
        "add": {"task": "arithmetic", "options": {"digits": 2, "ops": ["+"]}, "share": 0.5},
        "count": {
            "task": "countdown",
            "share": 0.5,
            "rewards": ["reward_count", "judge"],
            "weights": {"judge": 0.5},
            "accuracy": "reward_count",
        },
    }
    roles = cfg["roles"]
    for role in roles.values():
        role["options"]["model_dir"] = str(tiny_model)
    roles["reward"]["options"]["task"] = "arithmetic"
    # the domains are the scheduler's and the reward roles': the generator's engine plays no part (the torch
    # engine starts in a second where vLLM takes ~20 s; the judge keeps a vLLM engine)
    roles["generate"]["options"]["engine"] = "torch"
    roles["reward_count"] = {
        "worker": "rollhpc.workers.math_reward:MathRewardWorker",
        "procs": 1,
        "options": {"model_dir": str(tiny_model), "task": "countdown"},
    }
    roles["judge"] = {
        "worker": "rollhpc.workers.judge:JudgeWorker",
        "procs": 1,
        "options": {
            "policy_model_dir": str(tiny_model),
            "judge_model_dir": str(judge),
            "template": TEMPLATE,
            "task": "countdown",
            "max_model_len": 256,
            "cpu_kv_cache_mb": 32,
            "dtype": "float32",
            "threads": 1,
        },
    }
    path = tmp_path / "two_domains.yaml"
    path.write_text(yaml.safe_dump(cfg))
    plan = rollhpc("plan", str(path), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert all(role in plan.stdout for role in ("reward_count", "judge", "reward "))
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=600)
    run_dir = tmp_path / "runs" / "quickstart"
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"add/accuracy", "count/accuracy"} <= set(lines[0]) and {
        "add/accuracy",
        "count/accuracy",
    } <= set(lines[3])
    seen = set()
    for x in lines[1:]:
        for d, comp in (("add", "reward"), ("count", "reward_count")):
            if x.get(f"{d}/samples"):  # a domain in this batch: its reward, components, tokens
                assert {f"{d}/reward_mean", f"{d}/reward/{comp}", f"{d}/tokens_generated"} <= set(
                    x
                ), sorted(x)
                seen.add(d)
        assert (
            x.get("add/groups_started", 0) + x.get("count/groups_started", 0) == x["groups_started"]
        )
        assert x["judge/judge_calls"] >= 0 and "judge/judge_unparsed" in x
    assert seen == {"add", "count"}
    with h5py.File(run_dir / "rollouts" / "step_000003.h5") as f:
        domains = [d.decode() for d in f["domain"][()]]
        assert set(domains) <= {"add", "count"} and len(domains) == 4 * 8
        comps = {k: f["components"][k][()] for k in f["components"]}
        reward = f["reward"][()]
    for i, d in enumerate(domains):
        if d == "add":
            assert reward[i] == comps["reward"][i]
        else:  # rule + 0.5 x judge: the judge's YES is learnt for its template, so it mostly says 1
            assert reward[i] == pytest.approx(comps["reward_count"][i] + 0.5 * comps["judge"][i])
    assert_no_orphans(run_dir)
