"""Pipeline parallelism in the megatron trainer, on real MPI worlds over gloo: a layout with pipeline
stages computes what the one-stage model computes.

``tests.support.scenarios:TrainerLayoutScenario`` runs the train role on two fixed batches (log-probs, one
optimizer step each, a checkpoint after the first) and saves the losses, grad norms, log-probs and the
exported weights. Each layout is compared with the pp=1 run of the same model: PP2, PP2 x VPP2 (whose
micro-batch count is padded to a whole number of pipeline groups), TP2 x PP2 on 4 ranks, a Qwen2-MoE
policy at PP2 x EP2, and a PP2 checkpoint resumed at PP1 (DP2), whose next-step loss must match. The
dense model ties its embeddings, so the first and last stage's copies must stay equal (their gradients
summed across stages by megatron's finalize_model_grads): the exported weights would differ from pp=1's
otherwise. Every run trains on megatron-core's DDP and (distributed) optimizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.processes import assert_no_orphans, rollhpc

torch = pytest.importorskip("torch")

TRAIN = "rollhpc.workers.megatron_policy:MegatronTrainWorker"
LR = 1e-4
# the optimizer state per parameter: loads at any layout
RESHARDABLE = {"optimizer_checkpoint": "reshardable"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A dense Qwen2 of 4 layers with tied embeddings, and a Qwen2-MoE of 2 layers with an untied head."""
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 200, 10, digits=2, ops=("+",))
    tok = build_tokenizer(list(arithmetic.corpus(train)), 300)
    root = tmp_path_factory.mktemp("pp_models")
    return {
        "dense": create_tiny_model(root / "dense", TinyModelConfig(num_hidden_layers=4), tok),
        "moe": create_tiny_model(
            root / "moe", TinyModelConfig(moe=True, tie_word_embeddings=False), tok
        ),
    }


def _run(
    experiment,
    tmp_path: Path,
    name: str,
    model: Path,
    procs: int,
    parallel: dict,
    train_options: dict | None = None,
    **options,
) -> dict:
    path, run_dir = experiment(
        {
            "pipeline": {
                "entry": "tests.support.scenarios:TrainerLayoutScenario",
                "options": {"save_after": 1, **options},
            },
            "roles": {
                "train": {
                    "worker": TRAIN,
                    "procs": procs,
                    "parallel": parallel,
                    "options": {
                        "model_dir": str(model),
                        "micro_batch_size": 2,
                        "lr": LR,
                        **(train_options or {}),
                    },
                }
            },
        },
        name=name,
    )
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    assert_no_orphans(run_dir)
    out = torch.load(run_dir / "trainer.pt")
    out["run_dir"] = run_dir
    return out


@pytest.fixture(scope="module")
def pp2(models, tmp_path_factory) -> dict:
    """The dense model at PP2, its train role checkpointed after step 1 into RUN_DIR/ckpt: the run the resume test
    continues and ``ckpt inspect`` reads."""
    from tests.support.experiments import experiment_writer

    tmp = tmp_path_factory.mktemp("pp2")
    return _run(
        experiment_writer(tmp), tmp, "pp2", models["dense"], 2, {"pp": 2}, train_options=RESHARDABLE
    )


@pytest.fixture(scope="module")
def one_stage(models, tmp_path_factory) -> dict[str, dict]:
    """pp=1 runs (one rank) of both models: the reference every layout is compared with."""
    from tests.support.experiments import experiment_writer

    tmp = tmp_path_factory.mktemp("pp1")
    return {
        kind: _run(experiment_writer(tmp), tmp, f"pp1_{kind}", models[kind], 1, {})
        for kind in models
    }


def assert_same_training(got: dict, want: dict, steps: slice = slice(None)) -> None:
    assert got["loss"] == pytest.approx(want["loss"][steps], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"][steps], rel=1e-5)
    for a, b in zip(got["logprob"], want["logprob"][steps]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, w in want["weights"].items():
        # one Adam step moves a weight by about LR: a tenth of that is far above float noise, far below a
        # missing or doubled gradient
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=LR / 10, msg=name)


@pytest.mark.slow
# pp2 alone: test_pp2_checkpoint_resumes_at_dp2_and_dp1_and_converts_for_vllm
@pytest.mark.parametrize(
    "procs, parallel",
    [
        (2, {"pp": 2, "vpp": 2}),
        (4, {"tp": 2, "pp": 2}),
    ],
    ids=["pp2-vpp2", "tp2-pp2"],
)
def test_pipeline_stages_train_like_one_stage(
    models, one_stage, experiment, tmp_path, procs, parallel
):
    got = _run(experiment, tmp_path, "pp", models["dense"], procs, parallel)
    assert_same_training(got, one_stage["dense"])


@pytest.mark.slow
def test_moe_policy_with_pipeline_and_expert_parallel_in_bf16(
    models, one_stage, experiment, tmp_path
):
    """At PP2 x EP2 the routed experts' gradients are reduced over the expert-data-parallel group (DDP's expert
    buffers; the experts' fp32 main parameters sharded over that group). In bf16 (the model cast whole to bf16 as
    megatron's Float16Module does, its checkpoint saved after step 1) the run is the one-rank fp32 one within
    bf16's precision: losses and grad norms within 5%, weights within bf16 rounding plus 4.5 LR. (The same layout
    in fp32, exactly as one rank, under a token budget: test_r3_replays_the_given_routes_across_stages_and_recompute,
    whose routes are given.)"""
    got = _run(
        experiment,
        tmp_path,
        "moe_bf16",
        models["moe"],
        4,
        {"pp": 2, "ep": 2},
        train_options={"dtype": "bfloat16"},
    )
    want = one_stage["moe"]
    assert got["loss"] == pytest.approx(want["loss"], rel=5e-2, abs=1e-3)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-2)
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, w in want["weights"].items():
        assert got["weights"][name].dtype == torch.bfloat16, name
        torch.testing.assert_close(
            got["weights"][name].float(), w, rtol=2**-7, atol=4.5 * LR, msg=name
        )


# random routes of the MoE model's 2 layers, 4 experts, top 2 with every batch (the scenario's route_* options)
ROUTES = {"route_layers": 2, "route_experts": 4, "route_top_k": 2}


@pytest.fixture(scope="module")
def replayed_one_stage(models, tmp_path_factory) -> dict:
    """The MoE model on one rank replaying the batches' random routes (router_replay: r3)."""
    from tests.support.experiments import experiment_writer

    tmp = tmp_path_factory.mktemp("r3_pp1")
    return _run(
        experiment_writer(tmp),
        tmp,
        "r3_pp1",
        models["moe"],
        1,
        {},
        train_options={"router_replay": "r3"},
        **ROUTES,
    )


@pytest.mark.slow
def test_r2_replays_the_trainers_own_routes_as_it_recorded_them(
    models, one_stage, experiment, tmp_path
):
    """router_replay r2 at TP2 (sequence parallelism: each TP rank's routers see half of a micro-batch's tokens,
    and what they record is gathered): routes recorded in the old-log-prob forward (micro-batches of rows in
    batch order, full width) and replayed in training (longest rows first, each micro-batch cut to its own width,
    so a rank's half is another part of the row): a token given another token's experts, or another layer's,
    would change the loss; it trains exactly as one rank routing itself."""
    got = _run(
        experiment,
        tmp_path,
        "r2",
        models["moe"],
        2,
        {"tp": 2},
        train_options={"router_replay": "r2"},
    )
    assert_same_training(got, one_stage["moe"])
    assert got["route_differ"] == [0.0, 0.0]  # at the weights that recorded them, its own choices


@pytest.mark.slow
@pytest.mark.parametrize(
    "procs, parallel, options",
    [
        # a token budget of 3 full rows: one micro-batch per DP rank where the one-rank run takes 3
        (4, {"pp": 2, "ep": 2}, {"max_tokens_per_micro_batch": 36}),
        (4, {"tp": 2, "pp": 2}, {}),
        (1, {}, {"recompute": "full"}),
    ],
    ids=["pp2-ep2-token-budget", "tp2-pp2", "full-recompute"],
)
def test_r3_replays_the_given_routes_across_stages_and_recompute(
    models, one_stage, replayed_one_stage, experiment, tmp_path, procs, parallel, options
):
    """router_replay r3 with random routes in every batch: on 4 ranks (each pipeline stage holds one MoE layer,
    whose experts span two expert-parallel ranks, its micro-batches cut by a token budget whose count a collective
    agrees over the EP ranks; or TP2 x PP2, where sequence parallelism gives each TP rank's routers half of every
    micro-batch's tokens, its length padded to an even one), and on one rank under full recompute (each layer's
    forward run again in the backward, which must take the routes of the forward it repeats), the trainer computes
    what one rank computes with the same routes, and not what it computes routing itself."""
    got = _run(
        experiment,
        tmp_path,
        "r3",
        models["moe"],
        procs,
        parallel,
        train_options={"router_replay": "r3", **options},
        **ROUTES,
    )
    if "max_tokens_per_micro_batch" in options:
        assert got["micro_batches"] == [1, 1] and replayed_one_stage["micro_batches"] == [3, 3]
    assert_same_training(got, replayed_one_stage)
    # random pairs of 4 experts are the router's own pair about 1 time in 6 (the share differs a little with
    # the micro-batches' widths: the scenario's routes cover its padding too)
    assert got["route_differ"] == pytest.approx(replayed_one_stage["route_differ"], abs=0.02)
    assert all(0.6 < x < 0.95 for x in got["route_differ"]), got["route_differ"]
    own, replayed = one_stage["moe"]["logprob"][0], replayed_one_stage["logprob"][0]
    assert (own - replayed).abs().max() > 1e-3  # the given routes are not the ones it would take


@pytest.mark.slow
def test_pp2_checkpoint_resumes_at_dp2_and_dp1_and_converts_for_vllm(
    models, one_stage, pp2, experiment, tmp_path
):
    """Two pipeline stages train like one. Their checkpoint after step 1 (optimizer_checkpoint: reshardable), resumed by
    two data-parallel ranks of
    the whole model (the distributed optimizer's state resharded from PP2 to DP2, gradients reduce-scattered) and
    by one rank (gathered from its two shards; the rank files' RNG states start fresh), computes step 2's loss,
    log-probs and weights as the PP2 run did. The checkpoint's model converts to a Hugging Face directory holding
    exactly the trained weights, and vLLM generates from it the greedy tokens transformers gives."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.support.processes import REPO
    from tests.world.test_convert import PROMPTS, _hf_greedy

    assert_same_training(pp2, one_stage["dense"])
    for procs in (2, 1):
        resumed = _run(
            experiment,
            tmp_path,
            f"resumed_dp{procs}",
            models["dense"],
            procs,
            {},
            train_options=RESHARDABLE,
            resume_from=str(pp2["run_dir"] / "ckpt"),
        )
        assert len(resumed["loss"]) == 1
        assert_same_training(resumed, pp2, steps=slice(1, 2))

    hf = tmp_path / "hf"
    res = rollhpc(
        "convert", "mcore-to-hf", str(pp2["run_dir"] / "ckpt" / "model"), str(hf), cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    converted = {n: t for f in hf.glob("*.safetensors") for n, t in load_file(f).items()}
    assert converted.keys() == pp2["saved_weights"].keys()
    assert all(torch.equal(converted[n], t) for n, t in pp2["saved_weights"].items())
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(json.dumps({"converted": str(hf), "prompts": PROMPTS}))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "world" / "test_convert.py"), str(spec), str(result)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(result.read_text()) == [_hf_greedy(hf, p, 8) for p in PROMPTS]


@pytest.mark.slow
def test_dp2_sharded_optimizer_checkpoint_resumes_at_dp1(models, experiment, tmp_path):
    """The default optimizer checkpoint (``sharded``: each rank writes its shard of the distributed optimizer, as
    Megatron-LM saves by default) of a DP2 run after step 1, resumed by one rank (its two shards joined), computes
    step 2's loss, log-probs and weights as the DP2 run did (resumes at the same layout: the exact-resume tests of
    tests/world/test_requeue.py). Resumed at another pipeline split it is refused before anything loads, naming the layout
    change and the option that allows it."""
    dp2 = _run(experiment, tmp_path, "dp2", models["dense"], 2, {})
    resumed = _run(
        experiment,
        tmp_path,
        "dp2_resumed_dp1",
        models["dense"],
        1,
        {},
        resume_from=str(dp2["run_dir"] / "ckpt"),
    )
    assert len(resumed["loss"]) == 1
    assert_same_training(resumed, dp2, steps=slice(1, 2))
    path, _ = experiment(
        {
            "pipeline": {
                "entry": "tests.support.scenarios:TrainerLayoutScenario",
                "options": {"save_after": 1, "resume_from": str(dp2["run_dir"] / "ckpt")},
            },
            "roles": {
                "train": {
                    "worker": TRAIN,
                    "procs": 2,
                    "parallel": {"pp": 2},
                    "options": {"model_dir": str(models["dense"]), "micro_batch_size": 2, "lr": LR},
                }
            },
        },
        name="dp2_resumed_pp2",
    )
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=240)
    assert res.returncode != 0
    assert (
        "saved sharded (optimizer_checkpoint: sharded), which reshards over DP only, and this role's layout "
        "differs (pp 1 -> 2)" in res.stderr + res.stdout
    )


@pytest.mark.slow
def test_ckpt_inspect_shows_the_optimizer_state(pp2, tmp_path, capsys):
    """``rollhpc ckpt inspect`` on a run checkpoint holding the PP2 run's train role: megatron's distributed optimizer,
    saved by the two pipeline ranks (DP 1) after step 1 in its fully_reshardable format, its fp32 main parameters and
    both Adam moments each as many elements as the model has parameters (counted here from the exported weights and
    the padded vocabulary), one shard file per stage."""
    import json
    import re
    import shutil

    from rollhpc.checkpoint.storage import CheckpointStore, human_bytes
    from rollhpc.cli import main

    saved = pp2["run_dir"] / "ckpt"
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    pending = store.begin(1)
    shutil.copytree(saved, pending.path / "train")
    store.commit(pending, {})
    assert main(["ckpt", "inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    section = out[
        out.index("\noptimizer:\n") + 1 : out.index("\nfiles, largest first")
    ].splitlines()
    print("\n".join(section))

    meta = json.loads((saved / "model" / "rollhpc_checkpoint.json").read_text())
    hf = meta["hf_config"]
    params = (
        sum(t.numel() for t in pp2["saved_weights"].values())  # the tied embedding once
        + (meta["padded_vocab_size"] - hf["vocab_size"]) * hf["hidden_size"]
    )
    shards = sorted((saved / "optimizer").glob("*.distcp"))
    assert section[:3] == [
        "optimizer:",
        "  train: megatron distributed optimizer, saved by 2 ranks (tp 1, pp 2, dp 1), step 1",
        "    format torch_dist, fully_reshardable: gathered on DP rank 0 at save, loads at any TP/PP/DP layout",
    ]
    rows = {
        m["kind"]: m
        for m in (
            re.fullmatch(
                r"    (?P<kind>main params|exp_avg_sq|exp_avg) +(?P<tensors>\d+) +"
                r"(?P<elements>[\d,]+) +(?P<dtype>\S+) +(?P<bytes>.+)",
                line,
            )
            for line in section
        )
        if m
    }
    assert sorted(rows) == ["exp_avg", "exp_avg_sq", "main params"]
    for kind, row in rows.items():
        assert int(row["elements"].replace(",", "")) == params, kind
        assert (row["dtype"], row["bytes"]) == ("float32", human_bytes(4 * params)), kind
        assert row["tensors"] == rows["exp_avg"]["tensors"], kind
    assert len(shards) == 2  # one per pipeline stage: each DP group of one rank wrote its own
    assert section[-1] == (
        f"    2 shard files, {human_bytes(sum(f.stat().st_size for f in shards))} on disk; "
        f"the model: {params:,} parameters, float32"
    )


@pytest.mark.slow
def test_token_budget_micro_batches_train_like_fixed_rows(models, one_stage, experiment, tmp_path):
    """Rows of unequal length packed up to 40 tokens per micro-batch instead of 2 rows each: fewer micro-batches,
    the same losses, grad norms (the gradients) and weights, since the loss divides by the batch's global token
    count however the rows are split."""
    got = _run(
        experiment,
        tmp_path,
        "token_budget",
        models["dense"],
        1,
        {},
        train_options={"max_tokens_per_micro_batch": 40},
    )
    assert one_stage["dense"]["micro_batches"] == [3, 3] and all(
        m < 3 for m in got["micro_batches"]
    )
    assert_same_training(got, one_stage["dense"])


@pytest.mark.slow
def test_an_on_policy_step_needs_no_old_logprob_forward(models, one_stage, experiment, tmp_path):
    """Without old_logprob the train step takes its own forward's log-probs as the old ones (the RLVR
    pipeline skips the separate forward when the update is exactly on-policy): same losses, gradients
    (grad norms) and weights after two steps as with the separate forward."""
    got = _run(experiment, tmp_path, "on_policy", models["dense"], 1, {}, on_policy=True)
    assert got["logprob"] == []
    assert_same_training(got, {**one_stage["dense"], "logprob": []})


def _bind(worker, peer_max=None) -> None:
    """``MegatronPolicyWorker``'s micro-batch methods on a stand-in worker of one process; ``peer_max``: what the
    other ranks' all-reduce would bring (default: this rank's own values)."""
    from rollhpc.workers.megatron_policy import MegatronPolicyWorker

    for name in ("_shapes_are_local", "_micro_batch_index"):
        setattr(worker, name, getattr(MegatronPolicyWorker, name).__get__(worker))
    worker._role_max = lambda values: [max(a, b) for a, b in zip(values, peer_max or values)]


@pytest.mark.parametrize("vpp", [None, 2])
def test_training_micro_batches_are_cut_after_their_last_loss_token(vpp):
    """Rows go into micro-batches longest first and each micro-batch keeps the columns through its last
    loss token's target (causal attention: the columns after it change no loss term); every row and loss
    token is kept once. The interleaved schedule needs one shape: there every micro-batch has the batch's
    cut. Forward-only calls keep the full width (their log-probs are [B, L-1]), and so does expert parallelism."""
    from types import SimpleNamespace

    import numpy as np

    from rollhpc.batch import Batch
    from rollhpc.workers.megatron_policy import MegatronPolicyWorker

    ends = np.array([3, 9, 5, 4, 9, 2, 7])  # last loss position + 1 per row; width 12, so L-1 = 11
    mask = (np.arange(11)[None, :] < ends[:, None]) & (np.arange(11)[None, :] >= 1)
    tokens = np.arange(7 * 12).reshape(7, 12)
    batch = Batch(
        {
            "tokens": tokens,
            "loss_mask": mask.astype(np.float32),
            "advantage": np.arange(7.0),
            "old_logprob": -mask.astype(np.float32) * np.arange(7.0)[:, None],
        }
    )
    worker = SimpleNamespace(
        ctx=SimpleNamespace(layout=SimpleNamespace(pp=2 if vpp else 1, vpp=vpp, ep=1)),
        options=SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=0),
        device=torch.device("cpu"),
    )
    _bind(worker)
    parts = MegatronPolicyWorker._parts(worker, batch, with_mask=True)
    kept = [p for p in parts if p["keep"].any()]
    rows = [int(r) for p in kept for r, k in zip(p["tokens"][:, 0] // 12, p["keep"]) if k]
    assert sorted(rows) == list(range(7))
    if vpp:  # 4 micro-batches of 2 rows (one padding row), all cut at the longest row
        assert len(parts) == 4 and all(p["tokens"].shape[1] == 10 for p in parts)
    else:  # longest first: rows 1, 4 | 6, 2 | 3, 0 | 5
        assert rows == [1, 4, 6, 2, 3, 0, 5]
        assert [p["tokens"].shape[1] for p in parts] == [10, 8, 5, 3]
    for p in kept:
        r = p["tokens"][:, 0] // 12
        width = p["tokens"].shape[1]
        assert torch.equal(p["tokens"], torch.as_tensor(tokens[r.numpy(), :width]))
        assert p["loss_mask"].shape[1] == p["old_logprob"].shape[1] == width - 1
        assert torch.equal(p["advantage"], torch.as_tensor(np.arange(7.0)[r.numpy()]))
    assert sum(float(p["loss_mask"].sum()) for p in parts) == mask.sum()
    assert all(
        p["tokens"].shape[1] == 12
        for p in MegatronPolicyWorker._parts(worker, batch, with_mask=False)
    )
    # under expert parallelism other DP ranks' rows meet this rank's in the MoE dispatcher's collectives: the
    # micro-batches keep the batch's rows in order and its width there
    worker.ctx.layout.ep = 2
    uncut = MegatronPolicyWorker._parts(worker, batch, with_mask=True)
    assert all(p["tokens"].shape[1] == 12 for p in uncut)
    assert torch.equal(torch.cat([p["tokens"][p["keep"]] for p in uncut]), torch.as_tensor(tokens))


def test_token_budget_packs_rows_of_unequal_length():
    """``max_tokens_per_micro_batch``: longest first, each micro-batch as many rows as its longest row's width fits
    in the budget (a longer row alone); the interleaved schedule's one shape gets budget // the batch's cut rows.
    Under expert parallelism the ranks agree on the count and rows per micro-batch by an all-reduce of the largest:
    a rank holding fewer rows than a peer runs as many micro-batches, padded with rows it does not keep."""
    from types import SimpleNamespace

    import numpy as np

    from rollhpc.batch import Batch
    from rollhpc.workers.megatron_policy import MegatronPolicyWorker

    ends = np.array([3, 9, 5, 4, 9, 2, 7])  # token counts through the last target: 4 10 6 5 10 3 8
    mask = (np.arange(11)[None, :] < ends[:, None]) & (np.arange(11)[None, :] >= 1)
    batch = Batch(
        {
            "tokens": np.arange(7 * 12).reshape(7, 12),
            "loss_mask": mask.astype(np.float32),
            "advantage": np.arange(7.0),
        }
    )
    worker = SimpleNamespace(
        ctx=SimpleNamespace(layout=SimpleNamespace(pp=1, vpp=None, ep=1)),
        options=SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=24),
        device=torch.device("cpu"),
    )
    _bind(worker)

    def shapes(parts):
        return [(int(p["keep"].sum()), p["tokens"].shape[1]) for p in parts]

    parts = MegatronPolicyWorker._parts(worker, batch, with_mask=True)
    assert shapes(parts) == [(2, 10), (3, 8), (2, 4)]  # rows 1 4 | 6 2 3 | 0 5
    assert sum(float(p["loss_mask"].sum()) for p in parts) == mask.sum()
    worker.options.max_tokens_per_micro_batch = 7  # under any row: one row each
    assert shapes(MegatronPolicyWorker._parts(worker, batch, with_mask=True)) == [
        (1, 10),
        (1, 10),
        (1, 8),
        (1, 6),
        (1, 5),
        (1, 4),
        (1, 3),
    ]
    worker.options.max_tokens_per_micro_batch = 24
    # one shape: 24 // 10 = 2 rows, 4 micro-batches (pp groups)
    worker.ctx.layout.pp, worker.ctx.layout.vpp = (
        2,
        2,
    )
    assert shapes(MegatronPolicyWorker._parts(worker, batch, with_mask=True)) == [
        (2, 10),
        (2, 10),
        (2, 10),
        (1, 10),
    ]
    worker.ctx.layout.pp, worker.ctx.layout.vpp, worker.ctx.layout.ep = 1, None, 2
    assert shapes(MegatronPolicyWorker._parts(worker, batch, with_mask=True)) == [(2, 12)] * 3 + [
        (1, 12)
    ]
    # a peer holds 9 rows: ceil(9 / 2) = 5 micro-batches of ceil(9 / 5) = 2 rows; this rank's 7 rows pad to 10
    _bind(worker, peer_max=[5, 9])
    parts = MegatronPolicyWorker._parts(worker, batch, with_mask=True)
    assert [p["tokens"].shape for p in parts] == [(2, 12)] * 5 and shapes(parts)[-1] == (0, 12)
    assert float(parts[-1]["loss_mask"].sum()) == 0


@pytest.mark.slow
def test_rows_with_zero_advantage_are_skipped_without_changing_the_update(
    models, experiment, tmp_path
):
    """With no entropy or KL term, a row whose advantage is 0 has an exactly zero gradient: the trainer
    leaves it out of the forward/backward (``skip_zero_advantage``, on by default) and the losses, grad norms
    and weights after two steps are those of training on every row. 3 of 8 rows are zero, micro-batches of
    2, so the trained rows also fall into other micro-batches than without skipping."""
    runs = {
        skip: _run(
            experiment,
            tmp_path,
            f"skip_{skip}",
            models["dense"],
            1,
            {},
            rows=8,
            zero_advantage_rows=3,
            entropy_coef=0.0,
            on_policy=True,
            train_options={"skip_zero_advantage": skip},
        )
        for skip in (False, True)
    }
    assert runs[True]["rows_skipped"] == [3, 3] and runs[False]["rows_skipped"] == [0, 0]
    assert_same_training(runs[True], runs[False])


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_fp32_weights_and_trains_like_fp32(
    models, one_stage, experiment, tmp_path
):
    """mixed_precision=bf16 computes forward and backward in bfloat16 over float32 parameters: losses, grad
    norms and log-probs within bfloat16's precision of the float32 run's, the weights still float32. Two Adam
    steps move a weight by at most ~2 LR, so bfloat16 noise can put it at most 4 LR from the float32 run's
    (where a tiny gradient changes sign); that happens to few weights, and to some (the matmuls did run in
    bfloat16)."""
    got = _run(
        experiment,
        tmp_path,
        "bf16",
        models["dense"],
        1,
        {},
        train_options={"mixed_precision": "bf16"},
    )
    want = one_stage["dense"]
    assert got["loss"] == pytest.approx(want["loss"], rel=5e-2, abs=1e-3)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-2)
    for a, b in zip(got["logprob"], want["logprob"]):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-2)
    assert sorted(got["weights"]) == sorted(want["weights"])
    far, total = 0, 0
    for name, w in want["weights"].items():
        assert got["weights"][name].dtype == torch.float32, name
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=4.5 * LR, msg=name)
        far += int(((got["weights"][name] - w).abs() > LR).sum())
        total += w.numel()
    assert 0 < far < 0.01 * total


LORA = {"lora": {"rank": 4, "alpha": 8.0, "seed": 5}}
BASE_UNDER_ADAPTERS = """
import json, sys
import torch
from rollhpc.checkpoint.mcore import McoreReader, single_process_world
from rollhpc.models.lora import adapter_of
if __name__ == "__main__":
    with single_process_world():
        trained, start = McoreReader(sys.argv[1]), McoreReader(sys.argv[2])
        names = sorted(n for n in start.sharded if adapter_of(n, trained.lora))
        a, b = trained.read(names), start.read(names)
        print("RESULT " + json.dumps({"names": names, "differ": [n for n in names if not torch.equal(a[n], b[n])]}))
"""
LORA_LR = 1e-2  # adapters start at B = 0: at LR a step moves the merged weights by ~LR^2, too little to compare


@pytest.mark.slow
def test_lora_trains_alike_at_tp2_and_pp2_and_resumes_exactly(models, experiment, tmp_path):
    """LoRA on the megatron trainer (rollhpc.models.lora, through megatron's DDP and distributed optimizer): at TP2
    and at PP2 the losses, grad norms and merged weights of two steps are the one-rank run's; only the adapters
    move (every weight off the checkpoint's is an adapted module's, by the merged delta) and the base under them is
    bitwise the starting model's; the run's LoRA checkpoint after step 1 (base, adapters and their optimizer state)
    converts to the merged Hugging Face weights and resumes to step 2's numbers."""
    from safetensors.torch import load_file

    opts = {**LORA, "lr": LORA_LR}
    one = _run(experiment, tmp_path, "lora_pp1", models["dense"], 1, {}, train_options=opts)
    base = load_file(str(models["dense"] / "model.safetensors"))
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, w in one["weights"].items():
        moved = not torch.equal(w, base[name])
        # only adapted weights
        assert moved == (name.endswith(".weight") and name.split(".")[-2] in adapted), name
    for procs, parallel in ((2, {"tp": 2}), (2, {"pp": 2})):
        got = _run(
            experiment,
            tmp_path,
            f"lora_{'_'.join(f'{k}{v}' for k, v in parallel.items())}",
            models["dense"],
            procs,
            parallel,
            train_options=opts,
        )
        assert got["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        # Adam moves an element by about lr whatever its gradient's size: where a gradient is float noise (fc2's A
        # on MLP units that stay near zero) the layouts' noise differs, and the merged B A by up to ~lr x |B|
        # (measured: 3e-4 at TP2, 1e-6 at PP2). A tenth of lr is above that and far below an adapter that did not
        # train; the losses and grad norms above hold the gradients to float precision
        for name, w in one["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=LORA_LR / 10, msg=name)
    # the checkpoint converts to Hugging Face weights with the adapters merged: the policy it holds
    hf = tmp_path / "lora_hf"
    res = rollhpc(
        "convert", "mcore-to-hf", str(one["run_dir"] / "ckpt" / "model"), str(hf), cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    converted = {n: t for f in hf.glob("*.safetensors") for n, t in load_file(f).items()}
    assert converted.keys() == one["saved_weights"].keys()
    for name, w in one["saved_weights"].items():
        torch.testing.assert_close(converted[name], w, rtol=0, atol=1e-6, msg=name)
    # ... and its adapters to a PEFT adapter directory that PEFT loads onto the base: the same model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(models["dense"]), hf / "adapter"
        )
        torch.testing.assert_close(peft.eval()(ids).logits, merged, rtol=0, atol=1e-5)
    # the base under the adapters is bitwise the model the run started from: the LoRA checkpoint's own weights of
    # every adapted module against the starting model in megatron's layout
    start = tmp_path / "lora_start_mcore"
    res = rollhpc("convert", "hf-to-mcore", str(models["dense"]), str(start), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    import subprocess
    import sys

    from tests.support.processes import cli_env

    res = subprocess.run(
        [
            sys.executable,
            "-c",
            BASE_UNDER_ADAPTERS,
            str(one["run_dir"] / "ckpt" / "model"),
            str(start),
        ],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    base = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert {n.split(".")[-2] for n in base["names"]} == {
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    }
    assert base["differ"] == [], base
    resumed = _run(
        experiment,
        tmp_path,
        "lora_resumed",
        models["dense"],
        1,
        {},
        train_options=opts,
        resume_from=str(one["run_dir"] / "ckpt"),
    )
    # exactly: the adapters, their Adam state and the RNGs restored
    assert resumed["loss"] == one["loss"][1:]
    for name, w in one["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name
