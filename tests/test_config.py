import pytest

from rollhpc import config
from rollhpc.cli import compose, load_experiment
from rollhpc.config import ConfigError

PROBE = "rollhpc.workers.diagnostic:DiagnosticWorker"


def minimal(**over):
    data = {"run": {"name": "x"}, "pipeline": {"entry": "rollhpc.pipelines.selfcheck:SelfCheck"},
            "roles": {"probe": {"worker": PROBE, "procs": 2}}}
    data.update(over)
    return data


def test_minimal_config_loads_with_defaults():
    cfg = config.load(minimal())
    assert cfg.roles["probe"].procs == 2 and cfg.controller.call_timeout_s == 900.0
    assert cfg.world_size() == 3


def test_timeouts_must_be_positive():
    for name in ("call_timeout_s", "world_timeout_s", "startup_timeout_s"):
        with pytest.raises(ConfigError, match=rf"controller.{name}: must be positive, got 0"):
            config.load(minimal(controller={name: 0}))


def test_unknown_key_names_the_key_and_the_valid_ones():
    data = minimal()
    data["roles"]["probe"]["parallel"] = {"tpp": 2}
    with pytest.raises(ConfigError, match=r"config.roles.probe.parallel: unknown key 'tpp'; valid keys: tp, pp, cp, ep, etp, vpp, order"):
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
    with pytest.raises(ConfigError, match=r"pipeline.options: unknown key 'payload_gib'; valid keys: payload_mib"):
        config.load(minimal(pipeline={"entry": "rollhpc.pipelines.selfcheck:SelfCheck", "options": {"payload_gib": 1}}))
    with pytest.raises(ConfigError, match=r"DiagnosticWorker takes no options"):
        data = minimal()
        data["roles"]["probe"]["options"] = {"x": 1}
        config.load(data)


def test_bad_import_paths_and_layouts_fail_before_launch():
    data = minimal()
    data["roles"]["probe"]["worker"] = "rollhpc.workers.nope:Nope"
    with pytest.raises(ConfigError, match=r"roles.probe.worker: cannot import 'rollhpc.workers.nope:Nope'"):
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
    with pytest.raises(ConfigError, match=r"pipeline ToyGrpoPipeline needs a 'train' role; configured: \['probe'\]"):
        config.load(data)


def test_quickstart_composes_with_overrides_and_interpolation():
    cfg = load_experiment("toy_grpo", ["pipeline.options.modulus=7", "roles.train.procs=4"])
    assert cfg.roles["train"].procs == 4
    assert cfg.roles["generate"].options.modulus == 7  # follows the pipeline's modulus
    assert cfg.roles["train"].options.lr == 0.005


def test_hydra_rejects_unknown_override_and_unknown_experiment():
    with pytest.raises(ConfigError, match=r"config.pipeline: unknown key 'optionz'; valid keys: entry, options"):
        load_experiment("toy_grpo", ["pipeline.optionz.steps=3"])
    with pytest.raises(ConfigError, match="cannot apply overrides"):
        compose("toy_grpo", ["pipeline.options.steps=[unclosed"])
    with pytest.raises(ConfigError, match="unknown experiment 'quickstrat'; known: .*toy_grpo"):
        compose("quickstrat", [])
    with pytest.raises(ConfigError, match=r"unknown key 'stepz'"):
        load_experiment("toy_grpo", ["+pipeline.options.stepz=3"])


@pytest.mark.parametrize("name", sorted(p.stem for p in (config.Path(__file__).parents[1] / "configs").glob("*.yaml")))
def test_every_shipped_experiment_loads_and_plans(name):
    """configs/ are documentation users copy from: each one must load and map onto its cluster."""
    from rollhpc.launch.device_mapping import plan_world

    cfg = load_experiment(name, [])
    plan = plan_world(cfg)
    assert plan.world_size == cfg.world_size()
