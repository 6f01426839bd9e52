"""The suite's shared fixtures (session-scoped models and tokenizers) and how pytest-xdist spreads it.

tests/unit/ holds tests that start no process; tests/world/ those that start MPI worlds, Slurm jobs, engines,
sandboxes or the CLI; tests/support/ the helpers both use (tests/support/processes.py runs the CLI and probes)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.support.experiments import experiment_writer

pytest_plugins = ["tests.support.slurm_cluster"]


_INHERITED_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
)


@pytest.fixture(autouse=True)
def signal_dispositions_restored():
    """What a test's in-process product code does to this process's signals ends with the test. The batch-side
    code (e.g. rollhpc.launch.requeue.restart) ignores SIGTERM on purpose; left so, every process a later test
    of this worker starts inherits SIGTERM ignored across exec, and a rank that should die of SIGTERM did not
    (seen under pytest-xdist, where tests/world/test_requeue.py's in-process tests ran before tests/world/test_mpi_init_guard.py)."""
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


SLURM_MARK = re.compile(r"\bmark\.slurm\b")


def _slurm_modules(root: Path) -> set[str]:
    """Test modules that use the local Slurm cluster (a test marked `slurm`), as the paths node ids start with."""
    return {
        p.relative_to(root).as_posix()
        for p in (root / "tests").rglob("test_*.py")
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
