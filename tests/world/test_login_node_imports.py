"""What a login node runs imports no torch, megatron, vllm or transformers: loading every shipped config, ``rollhpc
plan`` and ``rollhpc submit --dry-run`` read the workers' and pipelines' specs (rollhpc.protocol.spec), never their
runtime modules. Nor does the controller's view of the workers (its worker groups' contracts, the colocation and
the start-up turns), which it builds from the same specs. One fresh interpreter runs them all and reports what
it imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.support.processes import REPO

HEAVY = ("torch", "megatron", "vllm", "transformers")
# runtime modules whose spec stands in for them on the login-node path: importing one would import its heavy
# libraries (at its top, or lazily in the methods a plan calls)
RUNTIMES = (
    "rollhpc.workers.megatron_policy",
    "rollhpc.workers.vllm_generate",
    "rollhpc.workers.toy_policy",
    "rollhpc.pipelines.rlvr",
    "rollhpc.pipelines.agentic",
)

_SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    from pathlib import Path
    heavy, runtimes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    from rollhpc.cli import main
    from rollhpc.cli.experiment import load_experiment
    from rollhpc.config import import_spec
    from rollhpc.controller.colocation import colocation_of
    from rollhpc.controller.startup import startup_turns
    from rollhpc.controller.worker_group import WorkerGroup

    names = sorted(p.stem for p in Path("configs").glob("*.yaml"))
    failed = {}
    for name in names:
        cfg = load_experiment(name, [])
        colocation_of(cfg.roles), startup_turns(cfg.roles)
        for role, rc in cfg.roles.items():
            group = WorkerGroup(None, role, import_spec(rc.worker, role), [], rc.layout())
            group.ping.contract
        for argv in (["plan", name], ["submit", name, "--dry-run"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
                rc = main(argv)
            if rc != 0:
                failed[" ".join(argv)] = err.getvalue()[-500:]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy or m in runtimes)
    print(json.dumps({"configs": names, "failed": failed, "modules": loaded}))
""")


def test_config_load_plan_and_dry_run_import_no_torch_megatron_or_vllm():
    res = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(HEAVY), json.dumps(RUNTIMES)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(report["configs"]) >= 10, report["configs"]
    assert report["failed"] == {}
    assert report["modules"] == [], f"the login-node path imported {report['modules']}"


def test_a_component_is_read_through_its_spec_module_or_is_its_own_spec():
    """``pkg.mod:Name`` -> ``pkg.mod_spec:NameSpec`` when that module exists (the runtime class subclasses it, so
    both give the same options and checks); a worker without a spec module (a third party's) is its own spec."""
    from rollhpc.config import import_object, import_spec
    from rollhpc.protocol.spec import WorkerSpec

    train = "rollhpc.workers.megatron_policy:MegatronTrainWorker"
    spec = import_spec(train, "roles.train.worker")
    assert spec.__name__ == "MegatronTrainWorkerSpec" and issubclass(spec, WorkerSpec)
    runtime = import_object(train, "roles.train.worker")
    assert issubclass(runtime, spec) and runtime.Options is spec.Options and runtime.trainable
    reward = "rollhpc.workers.math_reward:MathRewardWorker"
    assert import_spec(reward, "roles.reward.worker") is import_object(
        reward, "roles.reward.worker"
    )
