"""The RLVR pipeline end to end on real engines: Megatron trainer (TP=2), reference, vLLM generator,
math reward, all as MPI ranks, on a tiny random Qwen2 model."""

from __future__ import annotations

import json

import h5py
import pytest

from tests.conftest import assert_no_orphans, rollhpc


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rollhpc.models.tiny import TinyModelSpec, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinyModelSpec(),
                             build_tokenizer(list(arithmetic.corpus(train)), 300))


@pytest.mark.slow
def test_rlvr_steps_with_tp2_trainer_reference_and_kl(tmp_path, tiny_model):
    res = rollhpc("train", "quickstart", f"pipeline.options.model_dir={tiny_model}", "pipeline.options.steps=3",
                  "pipeline.options.eval_every=2", "pipeline.options.prompts_per_step=4",
                  "pipeline.options.rollout.dynamic_sampling=false", "pipeline.options.kl_in_reward=0.01",
                  "pipeline.options.loss.kl_coef=0.05", "pipeline.options.loss.entropy_coef=0.001",
                  "roles.train.procs=2", "roles.train.parallel.tp=2",
                  "+roles.reference.worker=rollhpc.workers.megatron_policy:MegatronReferenceWorker",
                  f"+roles.reference.options.model_dir={tiny_model}", cwd=tmp_path, timeout=600)
    run_dir = tmp_path / "runs" / "quickstart"
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert [x["policy_version"] for x in lines] == [0, 1, 2, 3]
    assert all("accuracy" in lines[i] for i in (0, 2, 3)) and "accuracy" not in lines[1]
    for x in lines[1:]:
        for key in ("reward_mean", "tokens_per_s", "rollout_s", "train_s", "weight_sync_s", "reference_s",
                    "train/kl", "train/entropy", "train/grad_norm", "generator_idle_fraction"):
            assert key in x, key
        # The generator samples with the weights the trainer just sent: both give the same log-probs
        # (the TP=2 trainer all-gathers its shards into HF names, the generator loads them in place).
        assert x["logprob_abs_diff"] < 1e-3, x["logprob_abs_diff"]
        assert x["train/grad_norm"] > 0
    with h5py.File(run_dir / "rollouts" / "step_000003.h5") as f:
        assert f.attrs["n"] == 4 * 8 and set(f["version"][()]) == {2}
        assert len(f["logprobs"]) == len(f["response_tokens"]) > 0
    assert any((run_dir / "tb").iterdir())
    assert_no_orphans(run_dir)
