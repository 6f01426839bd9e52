import pytest

from rollhpc import config
from rollhpc.cli.experiment import compose, load_experiment
from rollhpc.config import ConfigError
from rollhpc.config.cluster import parse_slurm_time

PROBE = "rollhpc.workers.diagnostic:DiagnosticWorker"


def minimal(**over):
    data = {
        "run": {"name": "x"},
        "pipeline": {"entry": "rollhpc.pipelines.selfcheck:SelfCheck"},
        "roles": {"probe": {"worker": PROBE, "procs": 2}},
    }
    data.update(over)
    return data


def test_minimal_config_loads_with_defaults():
    cfg = config.load(minimal())
    assert cfg.roles["probe"].procs == 2 and cfg.controller.call_timeout_s == 900.0
    assert cfg.world_size() == 3


def test_timeouts_must_be_positive():
    for name in ("call_timeout_s", "world_timeout_s", "startup_timeout_s", "mpi_stall_s"):
        with pytest.raises(ConfigError, match=rf"controller.{name}: must be positive, got 0"):
            config.load(minimal(controller={name: 0}))


def test_unknown_key_names_the_key_and_the_valid_ones():
    data = minimal()
    data["roles"]["probe"]["parallel"] = {"tpp": 2}
    with pytest.raises(
        ConfigError,
        match=r"config.roles.probe.parallel: unknown key 'tpp'; valid keys: tp, pp, cp, ep, etp, vpp, order",
    ):
        config.load(data)


def test_wrong_type_and_missing_key():
    data = minimal()
    data["roles"]["probe"]["procs"] = "two"
    with pytest.raises(ConfigError, match=r"roles.probe.procs: expected int, got 'two'"):
        config.load(data)
    data = minimal()
    del data["pipeline"]["entry"]
    with pytest.raises(ConfigError, match=r"config.pipeline: missing required key 'entry'"):
        config.load(data)


def test_component_options_are_validated_against_their_dataclass():
    with pytest.raises(
        ConfigError, match=r"pipeline.options: unknown key 'payload_gib'; valid keys: payload_mib"
    ):
        config.load(
            minimal(
                pipeline={
                    "entry": "rollhpc.pipelines.selfcheck:SelfCheck",
                    "options": {"payload_gib": 1},
                }
            )
        )
    with pytest.raises(ConfigError, match=r"DiagnosticWorker takes no options"):
        data = minimal()
        data["roles"]["probe"]["options"] = {"x": 1}
        config.load(data)


def test_bad_import_paths_and_layouts_fail_before_launch():
    data = minimal()
    data["roles"]["probe"]["worker"] = "rollhpc.workers.nope:Nope"
    with pytest.raises(
        ConfigError, match=r"roles.probe.worker: cannot import 'rollhpc.workers.nope:Nope'"
    ):
        config.load(data)
    data = minimal()
    data["roles"]["probe"]["worker"] = "rollhpc.batch:Batch"
    with pytest.raises(ConfigError, match="not a rollhpc Worker subclass"):
        config.load(data)
    data = minimal()
    data["roles"]["probe"]["parallel"] = {"tp": 4}
    with pytest.raises(ConfigError, match=r"roles.probe.parallel: 2 ranks cannot be split"):
        config.load(data)


def test_pipeline_declares_the_roles_it_needs():
    data = minimal(pipeline={"entry": "rollhpc.pipelines.toy_grpo:ToyGrpoPipeline"})
    with pytest.raises(
        ConfigError, match=r"pipeline ToyGrpoPipeline needs a 'train' role; configured: \['probe'\]"
    ):
        config.load(data)


def test_quickstart_composes_with_overrides_and_interpolation():
    cfg = load_experiment("toy_grpo", ["pipeline.options.modulus=7", "roles.train.procs=4"])
    assert cfg.roles["train"].procs == 4
    assert cfg.roles["generate"].options.modulus == 7  # follows the pipeline's modulus
    assert cfg.roles["train"].options.lr == 0.005


def test_hydra_rejects_unknown_override_and_unknown_experiment():
    with pytest.raises(
        ConfigError, match=r"config.pipeline: unknown key 'optionz'; valid keys: entry, options"
    ):
        load_experiment("toy_grpo", ["pipeline.optionz.steps=3"])
    with pytest.raises(
        ConfigError, match=r"override 'pipeline.options.steps=\[unclosed': .* \(hydra syntax"
    ):
        compose("toy_grpo", ["pipeline.options.steps=[unclosed"])
    with pytest.raises(ConfigError, match="unknown experiment 'quickstrat'; known: .*toy_grpo"):
        compose("quickstrat", [])
    with pytest.raises(ConfigError, match=r"unknown key 'stepz'"):
        load_experiment("toy_grpo", ["+pipeline.options.stepz=3"])


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in (config.Path(__file__).parents[2] / "configs").glob("*.yaml"))
)
def test_every_shipped_experiment_loads_and_plans(name, tmp_path, monkeypatch, capsys):
    """configs/ are documentation users copy from: each one must load and map onto its cluster, and `plan`,
    `train --dry-run` and `submit --dry-run` of it succeed on this machine without GPUs (a login node), where
    its models and data are not (issue 34)."""
    from rollhpc.cli import main
    from rollhpc.placement.device_mapping import plan_world

    cfg = load_experiment(name, [])
    plan = plan_world(cfg)
    assert plan.world_size == cfg.world_size()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("rollhpc.launch.local.local_gpu_count", lambda: 0)
    for command in (
        ["plan", name, "--no-ranks"],
        ["train", name, "--dry-run"],
        ["submit", name, "--dry-run"],
    ):
        assert main(command) == 0, command
        out = capsys.readouterr().out
        assert (
            ("rollhpc.rank" in out)
            if "--dry-run" in command
            else (f"{plan.world_size} MPI ranks" in out)
        ), command
    assert not (tmp_path / "runs").exists(), "a dry run writes nothing"


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 5400),
        ("90:30", 5430),
        ("4:00:00", 14400),
        ("1:90:00", 9000),
        ("2-12", 216000),
        ("2-12:30", 217800),
        ("1-00:00:01", 86401),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_slurm_time_limits_parse_to_seconds(text, seconds):
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["banana", "", "1:2:3:4", "1-", "-5", "1-2-3", "1:", ":30", "1h", " 90", "٣", "0", "0-0:00"],
)
def test_malformed_or_zero_slurm_time_limits_are_refused(text):
    with pytest.raises(
        ValueError,
        match="accepted forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours",
    ):
        parse_slurm_time(text)


def test_role_env_vars_are_names_and_strings_or_numbers():
    probe = {"worker": PROBE, "procs": 2}
    cfg = config.load(
        minimal(
            roles={
                "probe": {**probe, "env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": 2}}
            }
        )
    )
    assert cfg.roles["probe"].env_vars == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2"}
    with pytest.raises(
        ConfigError, match=r"^roles.probe.env_vars: '2X' is not an environment variable name"
    ):
        config.load(minimal(roles={"probe": {**probe, "env_vars": {"2X": "1"}}}))
    with pytest.raises(
        ConfigError, match=r"^roles.probe.env_vars.X: give a string \(or number\), got True"
    ):
        config.load(minimal(roles={"probe": {**probe, "env_vars": {"X": True}}}))


def test_cluster_time_limit_is_checked_at_load():
    with pytest.raises(
        ConfigError,
        match=r"^cluster.time_limit: 'banana' is not a Slurm time limit; accepted forms: "
        r"minutes, .*, UNLIMITED",
    ):
        config.load(minimal(cluster={"time_limit": "banana"}))
    with pytest.raises(
        ConfigError, match=r"^cluster.time_limit: '0' is zero, which Slurm reads as no limit"
    ):
        config.load(minimal(cluster={"time_limit": "0"}))
    with pytest.raises(
        ConfigError, match=r"got the number 14400, .*\(4:00:00 gives 14400\): quote it"
    ):
        # `time_limit: 4:00:00` unquoted in a YAML file
        config.load(minimal(cluster={"time_limit": 14400}))
    assert (
        load_experiment("toy_grpo", ["cluster.time_limit=2-00:00:00"]).cluster.time_limit
        == "2-00:00:00"
    )


def test_time_limit_warning_must_come_before_the_limit():
    with pytest.raises(
        ConfigError,
        match=r"cluster.stop_before_limit_s: 300 s is not shorter than "
        r"cluster.time_limit=5 \(300 s\): the time-limit warning would come at once",
    ):
        config.load(minimal(cluster={"time_limit": "5"}))
    assert (
        config.load(
            minimal(cluster={"time_limit": "5", "stop_before_limit_s": 0})
        ).cluster.time_limit
        == "5"
    )
    assert config.load(minimal(cluster={"time_limit": "UNLIMITED", "stop_before_limit_s": 10**6}))


def test_group_relative_algorithms_need_two_samples_per_group():
    for algorithm, why in (("grpo", "always 0 in a group of one"), ("rloo", "leave one out")):
        with pytest.raises(
            ConfigError,
            match=rf"pipeline.options: rollout.group_size=1 with algorithm={algorithm}: "
            rf".*{why}.*; set rollout.group_size >= 2, or .*algorithm=reinforce_pp",
        ):
            load_experiment(
                "quickstart",
                [
                    "pipeline.options.rollout.group_size=1",
                    f"pipeline.options.algorithm={algorithm}",
                ],
            )
    one = ["pipeline.options.rollout.group_size=1", "pipeline.options.algorithm=reinforce_pp"]
    with pytest.raises(
        ConfigError,
        match=r"rollout.group_size=1 with rollout.dynamic_sampling=true: dynamic sampling "
        r"drops every group whose rewards are all equal",
    ):
        load_experiment("quickstart", one)
    assert load_experiment("quickstart", [*one, "pipeline.options.rollout.dynamic_sampling=false"])
    with pytest.raises(
        ConfigError, match=r"pipeline.options: group_size=1: GRPO's advantage .* always 0"
    ):
        load_experiment("toy_grpo", ["pipeline.options.group_size=1"])


def test_missing_model_directories_are_named_by_key(tmp_path):
    gone = tmp_path / "gone"
    cfg = load_experiment("quickstart", [f"pipeline.options.model_dir={gone}"])
    assert config.missing_inputs(cfg) == []  # the warm start builds it before any rank starts
    cfg = load_experiment(
        "quickstart", [f"pipeline.options.model_dir={gone}", "pipeline.options.warm_start=null"]
    )
    assert config.missing_inputs(cfg) == [
        "pipeline.options.model_dir, roles.train.options.model_dir, roles.generate.options.model_dir, "
        f"roles.reward.options.model_dir: no model directory at {gone} (a Hugging Face checkpoint directory: "
        "point it at a local copy of the model, build a tiny one with `rollhpc sft DIR` or set "
        "pipeline.options.warm_start to build it at start)"
    ]
    model = tmp_path / "model"
    model.mkdir()
    other = [
        f"pipeline.options.model_dir={model}",
        "pipeline.options.warm_start=null",
        f"roles.reward.options.model_dir={gone}",
    ]
    # one message per path
    no_config, gone_too = config.missing_inputs(load_experiment("quickstart", other))
    assert no_config.startswith(
        f"pipeline.options.model_dir, roles.train.options.model_dir, "
        f"roles.generate.options.model_dir: {model} has no config.json"
    )
    assert gone_too.startswith(f"roles.reward.options.model_dir: no model directory at {gone} ")
    (model / "config.json").write_text("{}")
    (problem,) = config.missing_inputs(load_experiment("quickstart", other))
    assert problem.startswith(f"roles.reward.options.model_dir: no model directory at {gone} ")
    # a role reading the directory the warm start builds waits for it too; one elsewhere does not
    cfg = load_experiment(
        "quickstart",
        [
            f"pipeline.options.model_dir={gone}",
            f"roles.train.options.model_dir={gone}/",
            f"roles.reward.options.model_dir={tmp_path / 'elsewhere'}",
        ],
    )
    (problem,) = config.missing_inputs(cfg)
    assert problem.startswith("roles.reward.options.model_dir: no model directory at ")


def test_megatron_roles_refuse_context_parallelism_at_load():
    """megatron-core's local attention asserts cp == 1: refused at load, before any allocation."""
    data = minimal()
    data["roles"] = {
        "train": {
            "worker": "rollhpc.workers.megatron_policy:MegatronTrainWorker",
            "procs": 2,
            "parallel": {"cp": 2},
            "options": {"model_dir": "/nowhere"},
        }
    }
    with pytest.raises(
        ConfigError,
        match=r"roles.train.parallel: cp=2: context parallelism needs Transformer Engine",
    ):
        config.load(data)
    data["roles"]["train"]["parallel"] = {"pp": 2}
    assert config.load(data).roles["train"].layout().pp == 2


def test_agentic_advantage_follows_the_formulation_and_is_checked():
    assert load_experiment("sokoban", []).pipeline.options.advantage in ("episode", "gigpo")
    assert (
        load_experiment(
            "frozenlake", ["pipeline.options.formulation=step"]
        ).pipeline.options.advantage
        == "gigpo"
    )
    assert (
        load_experiment(
            "frozenlake", ["pipeline.options.advantage=gigpo"]
        ).pipeline.options.formulation
        == "trajectory"
    )
    with pytest.raises(ConfigError, match="formulation=step takes advantage=gigpo"):
        load_experiment(
            "frozenlake",
            ["pipeline.options.formulation=step", "pipeline.options.advantage=episode"],
        )
    with pytest.raises(ConfigError, match="advantage=gigpo with algorithm=rloo"):
        load_experiment(
            "frozenlake", ["pipeline.options.advantage=gigpo", "pipeline.options.algorithm=rloo"]
        )
    with pytest.raises(ConfigError, match="algorithm 'ppo' needs a 'critic' role"):
        load_experiment("frozenlake", ["pipeline.options.algorithm=ppo"])
    with pytest.raises(ConfigError, match="algorithm=ppo takes formulation=trajectory"):
        load_experiment(
            "frozenlake", ["pipeline.options.algorithm=ppo", "pipeline.options.formulation=step"]
        )


def _shape_mistakes(model: str) -> list[tuple[list[str], str]]:
    """(overrides of the quickstart, the start of the one-line error): resource, Slurm-syntax, token-budget and
    model-shape mistakes, each refused at load (the tiny model: 4 heads, 2 KV heads, 2 layers, FFN 352)."""
    m = [f"pipeline.options.model_dir={model}", "pipeline.options.warm_start=null"]
    tp = [*m, "roles.train.procs=4"]
    return [
        ([*m, "roles.train.cpus_per_proc=0"], "roles.train: cpus_per_proc must be >= 1"),
        ([*m, "roles.reward.cpus_per_proc=-1"], "roles.reward: cpus_per_proc must be >= 1"),
        (
            [*m, "roles.generate.gpus_per_proc=-1"],
            "roles.generate: cpus_per_proc must be >= 1 and gpus_per_proc >= 0",
        ),
        ([*m, "roles.reward.procs=0"], "roles.reward.procs: must be >= 1"),
        (
            [*m, "cluster.mem_per_node=lots"],
            "cluster.mem_per_node: 'lots' is not a Slurm memory size",
        ),
        (
            [*m, "cluster.mem_per_node=256 G"],
            "cluster.mem_per_node: '256 G' is not a Slurm memory size",
        ),
        (
            [*m, "cluster.mem_per_node=1.5T"],
            "cluster.mem_per_node: '1.5T' is not a Slurm memory size",
        ),
        (
            [*m, "cluster.partition='gpu debug'"],
            "cluster.partition: 'gpu debug' is not a Slurm partition name",
        ),
        (
            [*m, "cluster.partition='gpu;rm'"],
            "cluster.partition: 'gpu;rm' is not a Slurm partition name",
        ),
        (
            [*m, "cluster.rescue_partition='a b'"],
            "cluster.rescue_partition: 'a b' is not a Slurm partition name",
        ),
        (
            [*m, "cluster.account='my account'"],
            "cluster.account: 'my account' is not a Slurm account name",
        ),
        ([*m, "cluster.account='a,b'"], "cluster.account: 'a,b' is not a Slurm account name"),
        ([*m, "cluster.qos='high prio'"], "cluster.qos: 'high prio' is not a Slurm QOS name"),
        ([*m, "cluster.qos='$(id)'"], "cluster.qos: '$(id)' is not a Slurm QOS name"),
        (
            [*m, "+cluster.cpu_component.partition='cpu nodes'"],
            "cluster.cpu_component.partition: 'cpu nodes' is not a Slurm partition name",
        ),
        (
            [*m, "+cluster.cpu_component.mem_per_node=64GB"],
            "cluster.cpu_component.mem_per_node: '64GB' is not a Slurm",
        ),
        (
            [*m, "+cluster.cpu_component.qos='a;b'"],
            "cluster.cpu_component.qos: 'a;b' is not a Slurm QOS name",
        ),
        (
            [*m, "+cluster.cpu_component.cpus_per_node=-4"],
            "cluster.cpu_component.cpus_per_node and .nodes must be >= 0",
        ),
        (
            [*m, "+cluster.cpu_component.exclusive=sometimes"],
            "config.cluster.cpu_component.exclusive: expected bool",
        ),
        ([*m, "cluster.nodes=0"], "cluster.nodes and cluster.cpus_per_node must be >= 1"),
        ([*m, "cluster.cpus_per_node=0"], "cluster.nodes and cluster.cpus_per_node must be >= 1"),
        (
            [*m, "cluster.gpus_per_node=-8"],
            "cluster.nodes and cluster.cpus_per_node must be >= 1 and cluster.gpus_per_node >= 0",
        ),
        ([*m, "cluster.time_limit='1:2:3:4'"], "cluster.time_limit:"),
        (
            [*m, "cluster.time_limit='90:00'", "cluster.stop_before_limit_s=6000"],
            "cluster.stop_before_limit_s: 6000 s",
        ),
        (
            [*m, "pipeline.options.rollout.max_tokens=64"],
            "pipeline.options.rollout.max_tokens=64 does not fit "
            "roles.generate.options.max_model_len=64",
        ),
        (
            [*m, "pipeline.options.rollout.max_tokens=500"],
            "pipeline.options.rollout.max_tokens=500 does not fit",
        ),
        (
            [*m, "pipeline.options.eval_max_tokens=64"],
            "pipeline.options.eval_max_tokens=64 does not fit",
        ),
        (
            [*m, "roles.generate.options.max_model_len=8"],
            "pipeline.options.rollout.max_tokens=8 does not fit "
            "roles.generate.options.max_model_len=8",
        ),
        (
            [*m, "roles.generate.gpus_per_proc=2", "cluster.gpus_per_node=2"],
            "roles.generate.options.tensor_parallel_size=1 but roles.generate.gpus_per_proc=2",
        ),
        (
            [*m, "roles.generate.gpus_per_proc=1", "roles.generate.options.tensor_parallel_size=2"],
            "roles.generate.options.tensor_parallel_size=2 but roles.generate.gpus_per_proc=1",
        ),
        (
            [*m, "roles.train.procs=2", "roles.train.parallel.cp=2"],
            "roles.train.parallel: cp=2: context parallelism",
        ),
        (
            [*tp, "roles.train.parallel.tp=3", "roles.train.procs=3"],
            "roles.train.parallel: tp=3 does not divide the model's 4 attention heads",
        ),
        (
            [*m, "roles.train.procs=8", "roles.train.parallel.tp=8"],
            "roles.train.parallel: tp=8 does not divide",
        ),
        (
            [*m, "roles.train.procs=3", "roles.train.parallel.pp=3"],
            "roles.train.parallel: 2 layers cannot be split evenly into pp=3 x vpp=1 = 3 pipeline stages",
        ),
        (
            [*m, "roles.train.procs=4", "roles.train.parallel.pp=4"],
            "roles.train.parallel: 2 layers cannot be split evenly into pp=4 x vpp=1 = 4 pipeline stages",
        ),
        (
            [*m, "roles.train.procs=2", "roles.train.parallel.pp=2", "roles.train.parallel.vpp=2"],
            "roles.train.parallel: 2 layers cannot be split evenly into pp=2 x vpp=2 = 4 pipeline stages",
        ),
        (
            [*m, "roles.train.procs=2", "roles.train.parallel.ep=2"],
            "roles.train.parallel: ep=2 does not divide the model's 0 experts",
        ),
        (
            [*m, "roles.train.options.router_replay=r2"],
            "roles.train.parallel: router_replay=r2 replays the experts of MoE layers, and this model has none",
        ),
        (
            [
                *m,
                "pipeline.options.old_logprob_source=generator",
                "pipeline.options.loss.correction.weight=token",
            ],
            "pipeline.options: loss.correction weighs the trainer's old log-probs against the generator's",
        ),
        (
            [*m, "pipeline.options.loss.objective=cispo", "pipeline.options.loss.dual_clip=3.0"],
            "pipeline.options.loss: dual_clip is PPO-clip's: it needs objective ppo",
        ),
        (
            [
                *m,
                "+roles.reference.worker=rollhpc.workers.megatron_policy:MegatronReferenceWorker",
                f"+roles.reference.options.model_dir={model}",
                "+roles.reference.procs=3",
                "+roles.reference.parallel.tp=3",
            ],
            "roles.reference.parallel: tp=3 does not divide",
        ),
        ([*m, "roles.trian.procs=2"], "unknown role 'trian' (did you mean 'train'?)"),
        (
            [*m, "roles.generat.options.max_model_len=9"],
            "unknown role 'generat' (did you mean 'generate'?)",
        ),
        ([*m, "roles.train.parallel.tpp=2"], "config.roles.train.parallel: unknown key 'tpp'"),
        ([*m, "roles.train.procs=two"], "config.roles.train.procs: expected int, got 'two'"),
        (
            [*m, "roles.train.options.optimizer=torch"],
            "roles.train.options: unknown key 'optimizer'; valid keys: model_dir,",
        ),
        (
            [*m, "roles.train.options.dtype=bfloat16", "roles.train.options.mixed_precision=bf16"],
            "roles.train.options: mixed_precision=bf16 computes in bfloat16 over float32 parameters",
        ),
        (
            [*m, "roles.train.options.lr_schedule=cosine"],
            "roles.train.options: lr_schedule=cosine decays lr to min_lr over lr_decay_steps",
        ),
        (
            [*m, "roles.train.env_vars.A_B=[1]"],
            "roles.train.env_vars.A_B: give a string (or number), got [1]",
        ),
        ([*m, "controller.world_timeout_s=0"], "controller.world_timeout_s: must be positive"),
        ([*m, "controller.peer_loss_settle_s=-1"], "controller.peer_loss_settle_s: must be >= 0"),
        ([*m, "cluster.max_restarts=-1"], "config.cluster: cluster.max_restarts"),
        (
            [*m, "pipeline.options.export_hf=all"],
            "pipeline.options.export_hf: 'all' is not one of ['none', 'final']",
        ),
        (
            [*m, "pipeline.options.export_hf=final", "pipeline.options.checkpoint.at_end=false"],
            "pipeline.options: export_hf=final exports the run's final checkpoint, but checkpoint.at_end=false saves "
            "none",
        ),
    ]


def test_forty_mistakes_are_refused_at_load_in_one_line(tiny_model):
    """Table-driven: every mistake a ConfigError naming its keys, before anything starts (the CLI turns it into
    one line and exit status 2: tests/world/test_cli.py); the config without them loads."""
    mistakes = _shape_mistakes(str(tiny_model))
    assert len(mistakes) >= 40
    load_experiment("quickstart", mistakes[0][0][:2])
    for overrides, expected in mistakes:
        with pytest.raises(ConfigError) as e:
            load_experiment("quickstart", overrides)
        assert str(e.value).startswith(expected) and "\n" not in str(e.value), (
            overrides,
            str(e.value),
        )


def test_export_hf_final_is_an_option_of_both_training_pipelines():
    """RLVR and agentic share it (pipelines.training.TrainingOptions): final needs the checkpoint after the last
    step, which it exports."""
    for name in ("quickstart", "frozenlake"):
        assert (
            load_experiment(name, ["pipeline.options.export_hf=final"]).pipeline.options.export_hf
            == "final"
        )
        assert load_experiment(name, []).pipeline.options.export_hf == "none"
        with pytest.raises(ConfigError, match="export_hf=final exports the run's final checkpoint"):
            load_experiment(
                name,
                ["pipeline.options.export_hf=final", "pipeline.options.checkpoint.at_end=false"],
            )


def test_lora_on_a_moe_model_at_tp2_is_refused_and_tp2_alone_is_not(tmp_path):
    """A MoE model at tp > 1 runs sequence parallelism, which the LoRA adapters do not follow: refused at load
    (the model's config.json alone is read); the same model at tp 2 without LoRA, or with LoRA at tp 1, loads."""
    import json

    from rollhpc.models.lora_config import LoraConfig
    from rollhpc.parallel import ParallelLayout
    from rollhpc.workers.megatron_policy_spec import MegatronTrainWorkerSpec as Spec

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "intermediate_size": 64,
                "num_experts": 4,
            }
        )
    )
    lora = LoraConfig(target=["qkv", "proj"])
    with pytest.raises(ValueError, match="LoRA on a MoE model at tp=2: the model runs sequence"):
        Spec.check_model(
            ParallelLayout(world=2, tp=2), Spec.Options(model_dir=str(tmp_path), lora=lora)
        )
    Spec.check_model(ParallelLayout(world=2, tp=2), Spec.Options(model_dir=str(tmp_path)))
    Spec.check_model(ParallelLayout(world=1), Spec.Options(model_dir=str(tmp_path), lora=lora))
