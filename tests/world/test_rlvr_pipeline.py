"""The RLVR pipeline end to end on real engines: Megatron trainer (TP=2), reference, vLLM generator,
math reward, all as MPI ranks, on a tiny random Qwen2 model."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest

from tests.support.processes import assert_no_orphans, rollhpc
from tests.support.reports import assert_report


@pytest.mark.slow
def test_rlvr_steps_with_tp2_trainer_reference_and_kl(tmp_path, tiny_model):
    res = rollhpc(
        "train",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=3",
        "pipeline.options.eval_every=2",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.kl_in_reward=0.01",
        "pipeline.options.loss.kl_coef=0.05",
        "pipeline.options.loss.entropy_coef=0.001",
        "roles.train.procs=2",
        "roles.train.parallel.tp=2",
        "+roles.reference.worker=rollhpc.workers.megatron_policy:MegatronReferenceWorker",
        f"+roles.reference.options.model_dir={tiny_model}",
        cwd=tmp_path,
        timeout=600,
    )
    run_dir = tmp_path / "runs" / "quickstart"
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert [x["policy_version"] for x in lines] == [0, 1, 2, 3]
    assert all("accuracy" in lines[i] for i in (0, 2, 3)) and "accuracy" not in lines[1]
    assert (
        all(0 < lines[i]["eval_s"] < lines[i]["step_s"] for i in (2, 3))
        and "eval_s" not in lines[1]
    )
    for x in lines[1:]:
        for key in (
            "reward_mean",
            "tokens_per_s",
            "rollout_s",
            "train_s",
            "weight_sync_s",
            "reference_s",
            "train/kl",
            "train/entropy",
            "train/grad_norm",
            "generator_idle_fraction",
        ):
            assert key in x, key
        # The generator samples with the weights the trainer just sent: both give the same log-probs
        # (the TP=2 trainer all-gathers its shards into HF names, the generator loads them in place).
        assert x["logprob_abs_diff"] < 1e-3, x["logprob_abs_diff"]
        assert x["train/grad_norm"] > 0
        # each role's share of the step inside calls and the cores its processes used (the step's timeline)
        for role in ("train", "generate", "reward", "reference"):
            assert 0 < x[f"load/{role}/busy_fraction"] <= 1 and x[f"load/{role}/cpu_cores"] >= 0, (
                role
            )
        assert x["load/train/cpu_cores"] > 0 and x["load/controller/cpu_cores"] > 0
    with h5py.File(run_dir / "rollouts" / "step_000003.h5") as f:
        assert f.attrs["n"] == 4 * 8 and set(f["version"][()]) == {2}
        assert len(f["logprobs"]) == len(f["response_tokens"]) > 0
    assert any((run_dir / "tb").iterdir())
    assert_no_orphans(run_dir)


def assert_three_steps_in_sync(res, tmp_path) -> Path:
    """A 3-step quickstart run finished; after every weight sync the generator's log-probs equal the
    trainer's, and the trainer had a gradient. Returns the run directory."""
    run_dir = tmp_path / "runs" / "quickstart"
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [x["step"] for x in steps] == [1, 2, 3]
    for x in steps:
        assert x["logprob_abs_diff"] < 1e-4, x["logprob_abs_diff"]
        assert x["train/grad_norm"] > 0
    assert_no_orphans(run_dir)
    return run_dir


def assert_nothing_to_correct(run_dir: Path) -> None:
    """Engines in sync (float32 both, weights synced exactly): a loss.correction finds the policies equal, so it
    rejects nothing and weighs every token 1, and the mismatch metrics say so."""
    for x in [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]:
        assert x["mismatch_kl"] < 1e-6 and abs(x["mismatch_ratio_max"] - 1) < 1e-3, x
        assert x["correction_masked_frac"] == 0 and abs(x["correction_weight_mean"] - 1) < 1e-4, x


@pytest.mark.slow
def test_rlvr_with_a_pipeline_parallel_trainer_stays_in_sync_with_vllm(tmp_path, tiny_model):
    """The quickstart on a trainer of two pipeline stages (each holding one layer; the tied embedding on
    both): weights streamed from both stages reach vLLM exactly, the trainer's log-probs equal the
    generator's after every sync. The objective is CISPO with IcePop's correction (token weights, token
    rejection), through the pipeline schedule."""
    res = rollhpc(
        "train",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=3",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.loss.entropy_coef=0.01",
        "pipeline.options.loss.objective=cispo",
        "pipeline.options.loss.correction={weight: token, cap: 5, mask: token, mask_high: 5}",
        "roles.train.procs=2",
        "roles.train.parallel.pp=2",
        cwd=tmp_path,
        timeout=600,
    )
    run_dir = assert_three_steps_in_sync(res, tmp_path)
    assert_nothing_to_correct(run_dir)
    summary = assert_report(run_dir, tmp_path)  # the figures of a finished quickstart run
    assert "steps: 3 logged, 3 trained" in summary and "restarts: none" in summary
    assert "load per step (mean): controller " in summary and " train busy " in summary


@pytest.mark.slow
def test_rlvr_on_the_torch_engine_stays_in_sync_with_the_trainer(tmp_path, tiny_model):
    """``engine: torch`` (rollhpc.engines.torch_engine) as the generate role's engine, driven by the same
    rollout scheduler and engine loop: after every weight sync its log-probs equal the trainer's, and the
    evaluation runs through its batch path."""
    res = rollhpc(
        "train",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=3",
        "pipeline.options.eval_every=3",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.loss.entropy_coef=0.01",
        "roles.generate.options.engine=torch",
        cwd=tmp_path,
        timeout=600,
    )
    run_dir = assert_three_steps_in_sync(res, tmp_path)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "accuracy" in lines[0] and "accuracy" in lines[-1]
    assert "torch engine on cpu" in (run_dir / "logs" / "rank2-generate.log").read_text()


@pytest.mark.slow
def test_ppo_with_critic_async_partial_rollout(tmp_path, tiny_model):
    """PPO (critic + GAE) in async mode: the next batch is generated while the trainer works, partial
    responses resume under the new weights, and every sample stays within one version of the policy.
    Weights go through the controller (relay) here; the TP=2 test covers the direct broadcast. The critic
    runs on two pipeline stages (its value head on the last)."""
    res = rollhpc(
        "train",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=4",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.algorithm=ppo",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.rollout.max_staleness=1",
        "pipeline.options.rollout.partial_rollout=true",
        "pipeline.options.rollout.max_tokens=12",
        "pipeline.options.old_logprob_source=generator",
        "pipeline.options.weight_sync=relay",
        "pipeline.options.loss.entropy_coef=0.01",
        "+roles.critic.worker=rollhpc.workers.megatron_policy:MegatronCriticWorker",
        f"+roles.critic.options.model_dir={tiny_model}",
        "+roles.critic.options.lr=1e-3",
        "+roles.critic.procs=2",
        "+roles.critic.parallel.pp=2",
        cwd=tmp_path,
        timeout=600,
    )
    run_dir = tmp_path / "runs" / "quickstart"
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4]
    steps = lines[1:]
    assert all(x["train/critic_value_loss"] > 0 and x["train/critic_grad_norm"] > 0 for x in steps)
    assert all("critic_values_s" in x for x in steps)
    # batches after the first were generated by the policy one version behind the one that trains on them
    assert steps[0]["sample_version_lag"] == 0 and all(
        0 < x["sample_version_lag"] <= 1 for x in steps[1:]
    )
    assert "accuracy" in lines[0] and "accuracy" in lines[-1]
    assert_no_orphans(run_dir)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    """A tiny Qwen2-MoE policy (4 routed experts, top 2, a shared expert, an untied head) for the arithmetic task."""
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    return create_tiny_model(
        tmp_path_factory.mktemp("moe") / "tiny_moe",
        TinyModelConfig(moe=True, tie_word_embeddings=False),
        build_tokenizer(list(arithmetic.corpus(train)), 300),
    )


def moe_run(model: Path) -> list[str]:
    """The quickstart for three steps on the tiny MoE policy, an entropy bonus giving every step a gradient."""
    return [
        f"pipeline.options.model_dir={model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=3",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.loss.entropy_coef=0.05",
    ]


@pytest.mark.slow
def test_moe_policy_with_expert_parallel_trainer_stays_in_sync_with_vllm(tmp_path, tiny_moe):
    """A Qwen2-MoE policy (routed experts + shared expert, untied head) trained with EP=2: after every
    weight sync the generator's log-probs equal the trainer's on the same tokens. This is what caught
    vLLM's CPU MoE kernel keeping unpacked experts after a reload (rollhpc.engines.vllm_cpu_moe_repack):
    mean |diff| 0.05 without the repack. The objective is GSPO's token variant with NeMo-RL's sequence-mask
    TIS (token weights, whole rows rejected), split over the expert-parallel ranks, and the trainer replays the
    routes of its old-log-prob forward in training (router_replay: r2)."""
    res = rollhpc(
        "train",
        "quickstart",
        *moe_run(tiny_moe),
        "pipeline.options.loss={objective: gspo-token, clip_low: 3.0e-4, clip_high: 4.0e-4}",
        "pipeline.options.loss.correction={weight: token, mask: sequence}",
        "roles.train.procs=2",
        "roles.train.parallel.ep=2",
        "roles.train.options.router_replay=r2",
        cwd=tmp_path,
        timeout=600,
    )
    assert_nothing_to_correct(assert_three_steps_in_sync(res, tmp_path))


@pytest.mark.slow
def test_rlvr_with_lora_syncs_adapters_only_and_stays_in_sync(tmp_path, tiny_model):
    """LoRA on the train role with a KL term and no reference role: vLLM serves the adapters with its own LoRA
    (max_lora_rank), each sync moves them alone (a small share of the model's bytes), after every sync the
    generator's log-probs equal the trainer's (base + adapters), and the KL is measured against the frozen base.
    (The torch engine's merge of synced adapters: tests/unit/test_torch_engine.py.) The objective is GSPO with
    masked importance sampling (sequence weights, whole rows rejected)."""
    res = rollhpc(
        "train",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=3",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.loss.kl_coef=0.05",
        "pipeline.options.loss.entropy_coef=0.01",  # a gradient every step, whatever the rewards
        "roles.train.options.lr=1e-2",
        "pipeline.options.loss.objective=gspo",
        "pipeline.options.loss.correction={weight: sequence, mask: sequence}",
        "roles.train.options.lora={rank: 4, alpha: 8}",
        "roles.generate.options.max_lora_rank=8",
        cwd=tmp_path,
        timeout=600,
    )
    run_dir = assert_three_steps_in_sync(res, tmp_path)
    assert_nothing_to_correct(run_dir)
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    model_mb = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors")) / (1 << 20)
    for x in steps:
        assert 0 < x["weight_sync_mb"] < model_mb / 5, (x["weight_sync_mb"], model_mb)
        assert "reference_s" in x
    # B starts at zero: the policy is the base
    assert steps[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["train/kl"] > 0  # the adapters have moved it off the base
    assert "LoRA rank 4 on qkv,proj,fc1,fc2" in (run_dir / "logs" / "rank1-train.log").read_text()


def test_kl_without_reference_role_fails_at_load(tmp_path):
    res = rollhpc(
        "train", "quickstart", "pipeline.options.loss.kl_coef=0.1", "--dry-run", cwd=tmp_path
    )
    assert res.returncode != 0 and "needs a 'reference' role" in res.stderr
    res = rollhpc(
        "train",
        "quickstart",
        "pipeline.options.loss.kl_coef=0.1",
        "roles.train.options.lora={rank: 4}",
        "+roles.reference.worker=rollhpc.workers.megatron_policy:MegatronReferenceWorker",
        "+roles.reference.options.model_dir=runs/models/tiny-arith-sft",
        "--dry-run",
        cwd=tmp_path,
    )
    assert res.returncode != 0 and "the frozen base is the reference policy" in res.stderr
    res = rollhpc(
        "train", "quickstart", "roles.generate.options.max_lora_rank=8", "--dry-run", cwd=tmp_path
    )
    assert res.returncode != 0 and "roles.train.options has no lora" in res.stderr
    res = rollhpc(
        "train", "quickstart", "pipeline.options.algorithm=ppo", "--dry-run", cwd=tmp_path
    )
    assert res.returncode != 0 and "needs a 'critic' role" in res.stderr


@pytest.mark.slow
def test_colocated_roles_taking_turns_train_to_the_same_weights(tmp_path, tiny_model):
    """offload=true: before each stage the colocated roles (on CPU, every model role shares the host) give up
    what the stage does not use and take back what it does, through the same calls that free a GPU; the
    run ends with the weights of the same run with every role resident, and each step's metrics say which
    stages ran in which order and what moved."""
    args = [
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=2",
        "pipeline.options.eval_every=2",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.rollout.oversample=0",
        "pipeline.options.loss.kl_coef=0.05",
        "pipeline.options.loss.entropy_coef=0.01",
        "pipeline.options.skip_on_policy_logprobs=false",
        "+roles.reference.worker=rollhpc.workers.megatron_policy:MegatronReferenceWorker",
        f"+roles.reference.options.model_dir={tiny_model}",
        # vLLM has no sleep mode on CPU (its sleep frees nothing here, as the torch engine's does not): the
        # torch engine, which starts in a second where vLLM takes ~20 s, takes the same calls
        "roles.generate.options.engine=torch",
    ]
    runs = {}
    for offload in (False, True):
        cwd = tmp_path / f"offload_{offload}"
        cwd.mkdir()
        res = rollhpc(
            "train", *args, f"pipeline.options.offload={str(offload).lower()}", cwd=cwd, timeout=600
        )
        assert res.returncode == 0, res.stderr[-3000:]
        runs[offload] = [
            json.loads(x)
            for x in (cwd / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
        ]
    resident, turns = runs[False], runs[True]
    assert turns[-1]["weights_sha256"] == resident[-1]["weights_sha256"]
    assert [x.get("train/loss") for x in turns] == [x.get("train/loss") for x in resident]
    assert not any(k.startswith("residency/") for x in resident for k in x)
    start, first, second = turns
    # the generators get the weights, step 0's evaluation
    assert start["residency/stages"] == "weight_sync>generate"
    # generating already
    assert first["residency/stages"] == "old_logprob>reference>train>weight_sync"
    # + evaluation, then the final weights' digest, read with the trainer's state back (megatron's offload frees
    # the GPU storage of what it moves)
    assert (
        second["residency/stages"]
        == "generate>old_logprob>reference>train>weight_sync>generate>checkpoint"
    )
    for stage in ("generate", "old_logprob", "reference", "train", "weight_sync"):
        assert (
            second[f"residency/{stage}/offload_s"] >= 0
            and f"residency/{stage}/gpu_allocated_gb" in second
        )
    # the trainer's and the reference's states handed over
    assert second["residency/generate/offloaded_gb"] > 0
    # + grads, Adam
    assert second["residency/train/reloaded_gb"] > second["residency/old_logprob/reloaded_gb"] > 0
