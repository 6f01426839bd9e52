"""Helpers to run real MPI worlds through the real CLI, and to check nothing is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.slurm_cluster"]


def rank_processes(run_dir: Path) -> list[psutil.Process]:
    """Live processes started for this run: every rank has the run directory on its command line, and
    whatever a rank started (a multiprocessing server, an engine's worker) holds its log file open."""
    found, inside = [], str(run_dir) + os.sep
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if str(run_dir) in " ".join(p.info["cmdline"] or []) or any(
                f.path.startswith(inside) for f in p.open_files()
            ):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def assert_no_orphans(run_dir: Path, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while (left := rank_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {[p.info['cmdline'] for p in left]}"


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def rollhpc(*args: str, cwd: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", *args],
        cwd=cwd,
        env=cli_env(),
        text=True,
        capture_output=True,
        timeout=timeout,
        **kw,
    )


_INHERITED_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
)


@pytest.fixture(autouse=True)
def signal_dispositions_restored():
    """What a test's in-process product code does to this process's signals ends with the test. The batch-side
    code (e.g. rollhpc.launch.requeue.restart) ignores SIGTERM on purpose; left so, every process a later test
    of this worker starts inherits SIGTERM ignored across exec, and a rank that should die of SIGTERM did not
    (seen under pytest-xdist, where tests/test_requeue.py's in-process tests ran before tests/test_mpi_init_guard.py)."""
    saved = {s: signal.getsignal(s) for s in _INHERITED_SIGNALS}
    yield
    for s, handler in saved.items():
        if signal.getsignal(s) is not handler and handler is not None:
            signal.signal(s, handler)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (HF directory) with a tokenizer for 2-digit additions: the pipelines' test policy."""
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    return create_tiny_model(
        tmp_path_factory.mktemp("m") / "tiny",
        TinyModelConfig(),
        build_tokenizer(list(arithmetic.corpus(train)), 300),
    )


def experiment_writer(tmp_path: Path):
    """``make(data, name)``: write an experiment YAML under tmp_path; returns (yaml_path, run_dir)."""

    def make(data: dict, name: str = "t") -> tuple[Path, Path]:
        data = {
            **data,
            "run": {"name": name, "output_dir": str(tmp_path / "runs"), **data.get("run", {})},
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path, tmp_path / "runs" / name

    return make


@pytest.fixture
def experiment(tmp_path: Path):
    """Write an experiment YAML under tmp_path; returns (yaml_path, run_dir)."""
    return experiment_writer(tmp_path)


@pytest.fixture(scope="session")
def env_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained on text-environment transcripts (FrozenLake maps and moves, the test
    environments' counting game), saved as a model directory: what the env role and the scheduler tests encode
    observations with."""
    from rollhpc.warm_start.tiny import build_tokenizer

    texts = ["Reach G.\nP..H\n.H..\n...G\n> right\n> down\n> left\n> up"] * 20 + [
        f"Say go.\ncount {s}\n>\n> go\nyou said 'go' at step {n}\n> stop"
        for s in range(50)
        for n in range(4)
    ]
    path = tmp_path_factory.mktemp("env_tok")
    build_tokenizer(texts, 300).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def env_tok(env_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(env_tokenizer_dir)


def build_env_worker(run_dir: Path, **options):
    """The env role's worker built directly, as one rank of its own (no MPI: its methods are plain calls)."""
    from rollhpc.parallel import ParallelLayout
    from rollhpc.protocol.worker import WorkerContext
    from rollhpc.workers.env import EnvWorker

    ctx = WorkerContext(
        role="env",
        world_rank=1,
        coords=ParallelLayout(world=1).coords(0),
        group_size=1,
        role_comm=None,
        run_dir=run_dir,
        seed=0,
    )
    return EnvWorker(ctx, EnvWorker.Options(**options))


def run_probe(script: str, spec: dict, work: Path, timeout: float = 300) -> dict:
    """Run ``tests/<script>`` (a probe that needs a process of its own, e.g. vLLM's ``__main__`` guard) on ``spec``
    written as work/spec.json; returns the JSON it wrote to work/result.json, or fails with its output."""
    import json

    (work / "spec.json").write_text(json.dumps(spec))
    result = work / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / script), str(work / "spec.json"), str(result)],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(result.read_text())


# + training.png: a panel per logged quantity
REPORT_AXES = {
    "learning.png": 4,
    "throughput.png": 2,
    "stages.png": 1,
}


def assert_report(run_dir: Path, cwd: Path) -> str:
    """Run ``rollhpc report RUN_DIR``; check that every figure is a non-empty PNG with its expected number
    of axes (recorded in the PNG's Description chunk); returns summary.txt."""
    from PIL import Image

    from rollhpc.observability.report import load_run, training_panels

    res = rollhpc("report", str(run_dir), cwd=cwd, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    panels = len(training_panels([load_run(run_dir)]))
    assert panels >= 2, "a training run logs at least its loss and response length"
    for name, axes in {**REPORT_AXES, "training.png": panels}.items():
        with Image.open(run_dir / "report" / name) as img:
            assert img.format == "PNG" and img.width > 500 and img.height > 200, (name, img.size)
            assert img.info.get("Description") == f"axes={axes}", (name, img.info)
            low, high = img.convert("L").getextrema()
            assert high - low > 100, f"{name} looks blank"
    summary = (run_dir / "report" / "summary.txt").read_text()
    assert summary in res.stdout
    return summary


SLURM_MARK = re.compile(r"\bmark\.slurm\b")


def _slurm_modules(root: Path) -> set[str]:
    """Test modules that use the local Slurm cluster (a test marked `slurm`), as the paths node ids start with."""
    return {
        f"tests/{p.name}"
        for p in (root / "tests").glob("test_*.py")
        if SLURM_MARK.search(p.read_text())
    }


def pytest_xdist_make_scheduler(config, log):
    """How `make test` spreads the suite over two pytest-xdist workers (``-n 2``): much of the suite waits
    rather than computes (Slurm noticing a dead node, a world timeout, a time-limit warning), and a second
    worker fills those waits on a 2-core machine.

    - Every module is one work unit, so module fixtures (a reference run, built models) are made once.
    - The modules that use the local Slurm cluster form one unit together: one cluster per session, and the
      chaos tests crash its nodes, which another worker's Slurm job must never see.
    - Units go out in the workers' collection order, which puts the longest first (below).
    A scheduler of our own rather than xdist's ``loadgroup``: that one names a test's group by rewriting a node
    attribute pytest 9.2 no longer reads, so its groups are silently ignored."""
    from xdist.scheduler import LoadScopeScheduling

    slurm = _slurm_modules(Path(str(config.rootpath)))

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "slurm" if module in slurm else module

    config.option.loadscopereorder = False  # keep the order of pytest_collection_modifyitems below
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """In an xdist worker: the Slurm modules first, then modules by their count of `slow` tests, so the longest
    units go out first and the short ones even out the two workers' ends. A plain run keeps the usual order."""
    if not hasattr(config, "workerinput"):
        return
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    slurm = _slurm_modules(Path(str(config.rootpath)))

    def weight(module: str) -> tuple:
        slow = sum(1 for i in by_module[module] if i.get_closest_marker("slow"))
        return (module not in slurm, -slow, module)

    items[:] = [i for m in sorted(by_module, key=weight) for i in by_module[m]]
