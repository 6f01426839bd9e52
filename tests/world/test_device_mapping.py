import json

import pytest

from rollhpc import config
from rollhpc.config import ConfigError
from rollhpc.placement.device_mapping import WorldPlan, plan_world

TOY = "rollhpc.workers.toy_policy"


def experiment(roles: dict, **cluster) -> config.ExperimentConfig:
    data = {
        "run": {"name": "p"},
        "pipeline": {"entry": "rollhpc.pipelines.selfcheck:SelfCheck"},
        "roles": {
            name: {"worker": "rollhpc.workers.diagnostic:DiagnosticWorker", **r}
            for name, r in roles.items()
        },
        "cluster": {"nodes": 4, "gpus_per_node": 8, "cpus_per_node": 64, **cluster},
    }
    return config.load(data)


def test_colocated_roles_share_gpus_and_are_ordered_node_by_node():
    all16 = list(range(16))
    cfg = experiment(
        {
            "train": {"procs": 16, "gpus_per_proc": 1, "devices": all16},
            "generate": {"procs": 8, "gpus_per_proc": 2, "devices": all16},
            "reward": {"procs": 2},
        }
    )
    plan = plan_world(cfg)
    assert [c.roles for c in plan.components] == [["controller", "reward"], ["train", "generate"]]
    comp = plan.components[1]
    assert (comp.nodes, comp.ntasks, comp.ntasks_per_node, comp.gpus_per_node) == (2, 24, 12, 8)
    node0 = [p for p in plan.ranks if p.component == 1 and p.node == 0]
    assert [p.role for p in node0] == ["train"] * 8 + ["generate"] * 4
    assert [p.gpus for p in node0 if p.role == "generate"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    gen5 = next(p for p in plan.ranks if p.role == "generate" and p.group_rank == 5)
    assert (gen5.node, gen5.gpus) == (1, (2, 3))
    # node 1 starts after node 0's 12 ranks and the 3 CPU ranks
    assert plan.ranks_of("train")[8] == 15
    assert plan.gpus_total == 16 and plan.notes == ["colocated on GPUs 0-15: train, generate"]
    assert [p.rank for p in plan.ranks] == list(range(plan.world_size))


def test_a_nested_list_is_a_partial_overlap_naming_the_ranks_in_turns():
    cfg = experiment(
        {
            "generate": {"procs": 4, "gpus_per_proc": 2, "devices": list(range(8))},
            "train": {"procs": 4, "gpus_per_proc": 1, "devices": [2, 3, 0, 1]},
            "reward": {"procs": 1},
        },
        nodes=1,
    )
    plan = plan_world(cfg)
    assert [c.roles for c in plan.components] == [["controller", "reward"], ["generate", "train"]]
    assert plan.gpus_total == 8 and plan.components[1].ntasks == 8
    assert [p.gpus for p in plan.ranks if p.role == "train"] == [(2,), (3,), (0,), (1,)]
    assert plan.notes == [
        "colocated on GPUs 0-7: generate, train",
        "partial overlap: train on GPUs 0-3 only; generate ranks 0-1 take turns with it, ranks 2-3 "
        "hold their GPUs alone (with offload on and async generation, those alone keep generating "
        "during training)",
    ]


def test_colocation_moves_only_the_ranks_whose_devices_another_role_uses():
    from types import SimpleNamespace

    from rollhpc.controller.colocation import Colocation, colocation_of

    gen, train = (
        "rollhpc.workers.vllm_generate:VllmGenerateWorker",
        "rollhpc.workers.megatron_policy:MegatronPolicyWorker",
    )

    def role(worker, procs, gpus=0, devices=None):
        return SimpleNamespace(worker=worker, procs=procs, gpus_per_proc=gpus, devices=devices)

    partial = colocation_of(
        {
            "generate": role(gen, 4, 2, list(range(8))),
            "train": role(train, 4, 1, [0, 1, 2, 3]),
            "reward": role("rollhpc.workers.math_reward:MathRewardWorker", 1),
        }
    )
    assert partial.sets == (frozenset({"generate", "train"}),)
    assert partial.ranks == {"generate": frozenset({0, 1}), "train": frozenset(range(4))}
    assert partial.alone("generate", 4) == [2, 3] and partial.alone("train", 4) == []
    apart = colocation_of({"generate": role(gen, 2, 1, [0, 1]), "train": role(train, 2, 1, [2, 3])})
    assert apart == Colocation() and apart.alone("generate", 2) == [0, 1]
    cpu = colocation_of(
        {
            "generate": role(gen, 2),
            "train": role(train, 1),
            "reward": role("rollhpc.workers.math_reward:MathRewardWorker", 1),
        }
    )
    # on CPU every model role shares the host
    assert cpu.sets == (frozenset({"generate", "train"}),)
    assert cpu.alone("generate", 2) == []


def test_async_generation_with_offload_needs_generator_ranks_of_their_own(tmp_path):
    from rollhpc.cli.experiment import load_experiment

    args = [
        f"pipeline.options.model_dir={tmp_path}",
        "pipeline.options.warm_start=null",
        "pipeline.options.offload=true",
        "pipeline.options.rollout.max_staleness=1",
        "pipeline.options.rollout.partial_rollout=true",
    ]
    with pytest.raises(
        ConfigError, match="every generator rank shares its devices with roles that take turns"
    ):
        load_experiment("quickstart", args)  # on CPU every rank shares the host


def test_disaggregated_roles_get_own_gpus_and_no_rank_spans_nodes():
    cfg = experiment(
        {"train": {"procs": 3, "gpus_per_proc": 1}, "generate": {"procs": 3, "gpus_per_proc": 2}},
        nodes=3,
        gpus_per_node=4,
    )
    plan = plan_world(cfg)
    gen = [p for p in plan.ranks if p.role == "generate"]
    # train takes GPUs 0-2; generate's first rank cannot use GPU 3 alone, so it starts on node 1
    assert [(p.node, p.gpus) for p in gen] == [(0, (0, 1)), (0, (2, 3)), (1, (0, 1))]
    assert plan.components[2].nodes == 2 and plan.components[2].ntasks_per_node == 2


@pytest.mark.parametrize(
    "roles,cluster,msg",
    [
        (
            {"train": {"procs": 2, "gpus_per_proc": 1}},
            {"gpus_per_node": 0},
            "asks for 1 GPU(s) per rank but cluster.gpus_per_node is 0",
        ),
        (
            {"train": {"procs": 2, "gpus_per_proc": 1, "devices": [0, 1, 2]}},
            {},
            "3 GPUs listed but procs x gpus_per_proc = 2 x 1 = 2",
        ),
        (
            {"train": {"procs": 2, "gpus_per_proc": 1, "devices": [0, 40]}},
            {},
            "GPU ids [40] outside the cluster's 32 GPUs",
        ),
        (
            {
                "a": {"procs": 2, "gpus_per_proc": 1, "devices": [0, 1]},
                "b": {"procs": 2, "gpus_per_proc": 1, "devices": [1, 2]},
            },
            {},
            "roles.b.devices: shares GPU 1 with role 'a' but neither list holds the other",
        ),
        (
            {"train": {"procs": 1, "gpus_per_proc": 16}},
            {},
            "16 GPUs per rank do not fit on a node of 8",
        ),
        (
            {"train": {"procs": 40, "gpus_per_proc": 1}},
            {},
            "needs 40 GPUs but the cluster has no 40 free GPUs left (32 in all",
        ),
        (
            {"train": {"procs": 2, "gpus_per_proc": 1, "devices": [7, 8]}},
            {},
            "rank 0 would drive GPUs",
        ),
        (
            {"reward": {"procs": 200}},
            {"nodes": 2, "cpus_per_node": 64},
            "the controller and CPU roles need 4 nodes",
        ),
        (
            {"reward": {"procs": 200}},
            {"cpu_component": {"nodes": 1, "cpus_per_node": 128}},
            "the controller and CPU roles need 2 nodes (201 ranks, 128 per node of 128 CPUs) but cluster.cpu_component.nodes is 1",
        ),
        (
            {"reward": {"procs": 2, "cpus_per_proc": 16}},
            {"cpu_component": {"cpus_per_node": 8}},
            "roles.reward.cpus_per_proc: 16 CPUs per rank do not fit on a node of the controller's het group "
            "(cluster.cpu_component.cpus_per_node = 8)",
        ),
    ],
)
def test_impossible_mappings_fail_with_one_message(roles, cluster, msg):
    if roles.get("train", {}).get("devices") == [7, 8]:
        roles["train"]["gpus_per_proc"] = 2
        roles["train"]["procs"] = 1
    with pytest.raises(
        ConfigError,
        match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
    ):
        plan_world(experiment(roles, **cluster))


def test_cpu_component_packs_by_its_own_node_size_not_the_gpu_nodes():
    """Het group 0 on a CPU partition: ranks per node from cluster.cpu_component.cpus_per_node, its node count
    bounded by cluster.cpu_component.nodes, not by the GPU nodes of cluster.nodes."""
    cfg = experiment(
        {"train": {"procs": 8, "gpus_per_proc": 1}, "reward": {"procs": 47, "cpus_per_proc": 2}},
        nodes=1,
        cpu_component={"partition": "cpu", "cpus_per_node": 32, "nodes": 3},
    )
    comp = plan_world(cfg).components[0]
    assert (comp.nodes, comp.ntasks, comp.ntasks_per_node, comp.cpus_per_task) == (3, 48, 16, 2)


def test_plan_round_trips_through_json(tmp_path):
    cfg = experiment({"train": {"procs": 4, "gpus_per_proc": 1}, "reward": {"procs": 1}})
    plan = plan_world(cfg)
    plan.save(tmp_path / "plan.json")
    assert WorldPlan.load(tmp_path / "plan.json") == plan


def test_4096_gpu_plan_is_complete():
    cfg = experiment(
        {
            "train": {"procs": 4096, "gpus_per_proc": 1, "parallel": {"tp": 8, "pp": 4}},
            "generate": {"procs": 512, "gpus_per_proc": 8, "devices": None},
        },
        nodes=1100,
        gpus_per_node=8,
    )
    plan = plan_world(cfg)
    assert plan.world_size == 1 + 4096 + 512 and plan.gpus_total == 8192
    assert plan.components[1].nodes == 512 and plan.components[2].nodes == 512


def test_local_plan_keeps_everything_on_this_machine():
    from rollhpc.cli.experiment import load_experiment
    from rollhpc.launch.local import local_plan

    plan = local_plan(load_experiment("toy_grpo", []))
    assert len(plan.components) == 1 and plan.components[0].nodes == 1
    assert [p.role for p in plan.ranks] == ["controller", "train", "train", "generate", "reward"]
    with pytest.raises(ConfigError, match=r"cannot run on this machine \(0 GPUs\)"):
        local_plan(load_experiment("toy_grpo", ["roles.train.gpus_per_proc=1"]))


# -- GPU memory, stage by stage (rollhpc.placement.memory_plan) ----------------------------------------------
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "hf",
    [
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "tie_word_embeddings": True,
        },
        QWEN25_7B,
        {
            "model_type": "qwen2_moe",
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "tie_word_embeddings": False,
        },
        {
            "model_type": "qwen3_moe",
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 300,
            "tie_word_embeddings": False,
        },
    ],
    ids=["tiny-tied", "qwen2.5-7b", "qwen2-moe", "qwen3-moe"],
)
def test_parameter_counts_match_the_models_transformers_builds(hf):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollhpc.placement.memory_plan import ModelShape

    with torch.device("meta"):  # shapes only: a 7B model costs no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    expected = sum(p.numel() for p in model.parameters())
    # q/k norms of Qwen3 left out
    assert ModelShape.from_hf(hf).total == pytest.approx(expected, rel=0.002)


def test_the_vllm_cpu_host_estimate_covers_the_engines_measured_peaks():
    """The generator's CPU form (VllmGenerateWorker.host_memory) against bench/vllm_cpu_memory.py's record of the
    0.5B-shape engine: its only measured term is vLLM's runtime (the level after the build less the shape's parts);
    the weight sync's transient comes from the shape and must cover the four measured sync peaks within 25%."""
    from rollhpc.placement.memory_plan import ModelShape
    from rollhpc.workers.vllm_generate import VllmGenerateWorker

    from tests.support.processes import REPO

    record = json.loads((REPO / "bench" / "results" / "vllm_cpu_memory.json").read_text())
    s = record["shape"]
    shape = ModelShape.from_hf(
        {
            "model_type": "qwen2",
            "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"],
            "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"],
            "intermediate_size": s["intermediate"],
            "vocab_size": s["vocab"],
            "tie_word_embeddings": True,
        }
    )
    assert shape.total == record["parameters"]
    options = VllmGenerateWorker.Options(model_dir="unused", dtype="bfloat16", cpu_kv_cache_mb=128)
    parts = VllmGenerateWorker.host_memory(options, shape, sync_bucket_bytes=64 << 20)
    estimate = sum(parts.values()) / 2**30
    peaks = [gib for phase, gib in record["above_baseline_gib"].items() if phase.startswith("sync")]
    assert len(peaks) == 4 and all(abs(peak / estimate - 1) <= 0.25 for peak in peaks), (
        estimate,
        peaks,
    )
    # the torch engine's is not measured
    assert (
        VllmGenerateWorker.host_memory(
            VllmGenerateWorker.Options(model_dir="unused", engine="torch"),
            shape,
            sync_bucket_bytes=0,
        )
        is None
    )


def test_plan_reports_memory_per_stage_and_refuses_what_cannot_fit(tmp_path):
    import json

    from tests.support.processes import rollhpc

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    args = ["qwen2.5-7b_grpo", f"pipeline.options.model_dir={tmp_path}", "--no-ranks"]
    fits = rollhpc("plan", *args, cwd=tmp_path)  # the config's 80 GB GPUs, offload on
    assert fits.returncode == 0, fits.stderr
    lines = fits.stdout.splitlines()
    # trainer rank 0's GPU (two slots of the largest tensor, 1.0 GiB, the one being packed, generator 0's copy over
    # CUDA IPC), the other generators' first GPUs (two NCCL buckets each), the rest
    peaks = [line for line in lines if line.split()[:1] == ["peak"]]
    assert (
        len(peaks) == 3
        and "a weight sync's buckets 4.1)" in fits.stdout
        and "buckets 2.0)" in fits.stdout
    )
    off, on = map(float, peaks[0].split()[1:3])
    # colocated: fits by turns
    assert on < 74.5 < off and peaks[0].endswith("fits 74.5 GiB only with offload")
    assert {line.split()[0] for line in lines if line.startswith("    ")} >= {
        "startup",
        "generate",
        "reference",
        "old_logprob",
        "train",
        "weight_sync",
        "train:",
        "reference:",
        "generate:",
    }
    resident = rollhpc(
        "plan", *args, "cluster.gpu_memory_gb=80", "pipeline.options.offload=false", cwd=tmp_path
    )
    assert (
        resident.returncode == 2
        and "held at once, more than cluster.gpu_memory_gb=80 GB" in resident.stderr
    )
    assert (
        "set pipeline.options.offload=true (the colocated roles then take turns: about 51"
        in resident.stderr
    )
    half = "[0,1,2,3,4,5,6,7]"  # trainer and reference on half of the generators' GPUs, generating async
    partial = rollhpc(
        "plan",
        *args,
        "roles.train.procs=8",
        f"roles.train.devices={half}",
        "roles.reference.procs=8",
        f"roles.reference.devices={half}",
        "pipeline.options.rollout.max_staleness=1",
        cwd=tmp_path,
    )
    assert partial.returncode == 0, partial.stderr
    assert (
        "partial overlap: train, reference on GPUs 0-7 only; generate ranks 0-3 take turns with them, ranks 4-7 "
        "hold their GPUs alone" in partial.stdout
    )
    alone = partial.stdout.split("of het group 1: generate (1 process(es) per GPU)")[1].splitlines()
    assert "(no turns to take)" in alone[2] and alone[3].split()[:3] == ["peak", "34.0", "34.0"]
    receiving = partial.stdout.split(
        "generate (1 process(es) per GPU; a weight sync's buckets 2.0)"
    )[1].splitlines()
    # two 1.0 GiB buckets beside its engine
    assert receiving[3].split()[:3] == [
        "peak",
        "36.1",
        "36.1",
    ]
    small = rollhpc("plan", *args, "cluster.gpu_memory_gb=40", cwd=tmp_path)
    assert small.returncode == 2 and "the train stage needs about" in small.stderr
    assert "more than cluster.gpu_memory_gb=40 GB" in small.stderr and small.stderr.count("\n") == 1
    submit = rollhpc("submit", *args[:-1], "cluster.gpu_memory_gb=40", "--dry-run", cwd=tmp_path)
    # before any sbatch text
    assert submit.returncode == 2 and "the train stage needs about" in submit.stderr
    assert "#SBATCH" not in submit.stdout


def test_the_lora_7b_config_fits_half_the_gpus(tmp_path):
    """qwen2.5-7b_grpo_lora: adapters alone take gradients and Adam state, the base is the reference: the 7B run
    fits 8 GPUs of 80 GB (the full fine-tuning config takes 16), by the plan's train stage."""
    import json

    from tests.support.processes import rollhpc

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    res = rollhpc(
        "plan",
        "qwen2.5-7b_grpo_lora",
        f"pipeline.options.model_dir={tmp_path}",
        "--no-ranks",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert "8 GPUs; cluster: 1 nodes x 8 GPUs" in res.stdout
    train = next(
        line for line in res.stdout.splitlines() if line.strip().startswith("train: parameters")
    )
    parts = dict(p.strip().rsplit(" ", 1) for p in train.split(":", 1)[1].split(","))
    # GiB: the adapters' only
    assert float(parts["gradients"]) < 1 and float(parts["optimizer"]) < 1
    peaks = [line for line in res.stdout.splitlines() if line.split()[:1] == ["peak"]]
    # with the sync's buckets or not
    assert len(peaks) == 3 and all(float(peak.split()[2]) < 74.5 for peak in peaks)


def test_stage_moves_make_room_only_on_the_stages_devices():
    from rollhpc.controller.colocation import moves_for
    from rollhpc.pipelines.training import TrainingPipeline

    # two pairs of roles, each on GPUs of its own
    sets = [
        {"train", "reference"},
        {"generate", "critic"},
    ]
    trainer = {"parameters", "gradients", "optimizer"}
    loaded = {
        "train": set(trainer),
        "reference": {"parameters"},
        "generate": {"weights", "kv_cache"},
        "critic": set(trainer),
    }
    stage = TrainingPipeline.memory_stages["reference"]
    needed = {
        r: {
            p for p in parts if p in ("parameters", "gradients", "optimizer", "weights", "kv_cache")
        }
        for r, parts in stage.items()
        if r in loaded
    }
    drop, take = moves_for(needed, loaded, sets, whole={"generate"})
    # the other pair stays
    assert drop == {"train": trainer, "reference": set()} and take == {"reference": set()}
    drop, take = moves_for(
        {"generate": {"weights"}, "train": {"parameters"}}, loaded, sets, whole={"generate"}
    )
    assert drop["critic"] == trainer and drop["train"] == {"gradients", "optimizer"}
    # an engine sleeps whole: with no other role of its set to make room for, it
    assert drop["generate"] == set()
    assert take["generate"] == set()  # keeps its KV cache while it needs its weights
    drop, take = moves_for(
        {"generate": {"weights"}, "critic": {"parameters"}}, loaded, sets, whole={"generate"}
    )
    # else it sleeps, wakes
    assert drop["generate"] == {"weights", "kv_cache"} and take["generate"] == {"weights"}
    # its weights alone (the critic's parameters need room)
    assert drop["critic"] == {
        "gradients",
        "optimizer",
    }
    loaded["generate"] = set()
    _, take = moves_for({"generate": {"weights"}}, loaded, sets, whole={"generate"})
    assert take == {"generate": {"weights"}}  # a weight sync wakes the weights alone
