"""The RL pipeline's starting policy: a tiny Qwen2 model fine-tuned on a task, as a cached HF directory.

``prepare_policy`` trains a tokenizer on the task's train split, creates the tiny model
(``rollhpc.warm_start.tiny``), runs SFT on the same split and writes an ordinary Hugging Face directory
with ``sft_report.json`` beside the weights. The directory appears whole or not at all (built
in a temp dir beside it, renamed into place). It doubles as a cache: asked again with the same
settings it is returned untouched; asked with other settings it is refused, never overwritten.

The building itself (torch, transformers) is ``rollhpc.warm_start.policy_build``, imported only when
a directory is built: this module is read when a config loads.

The held-out split is the task's own (``make_splits`` with the recorded seed and sizes), so the
RL pipeline can measure improvement on exactly the examples the report measured: ``policy_splits``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollhpc import file_modes
from rollhpc.tasks import task_module
from rollhpc.warm_start.sft_config import SftConfig
from rollhpc.warm_start.tiny_config import TinyModelConfig

log = logging.getLogger("rollhpc.sft")
# Chosen by experiment: with the default SftConfig, 2-digit addition stops after 470-1240 steps
# (20-60 s on one CPU thread) at 0.15-0.27 held-out greedy accuracy (seeds 0-7), just as the model
# starts to read the units digits; more SFT takes the same model past 0.9, so RL has room to climb.
# (3-digit addition is still at ~0.13 after 3000 steps: too far from its jump to be a good start.)
DEFAULT_TASK_OPTIONS: dict[str, dict[str, Any]] = {
    "arithmetic": {"digits": 2, "ops": ["+"]},
}
REPORT = "sft_report.json"
# bump when a code change alters what the same settings produce (invalidates caches)
FORMAT_VERSION = 1


def resolve_task_options(task: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The task's defaults overridden by ``options``; unknown keys raise with the allowed list.

    Sequences become lists, so the result is JSON as it will be recorded (``task_splits`` turns
    them back into the tuples ``make_splits`` takes).
    """
    allowed = [
        n
        for n in inspect.signature(task_module(task).make_splits).parameters
        if n not in ("seed", "n_train", "n_heldout")
    ]
    unknown = sorted(set(options or {}) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for task {task!r}; allowed: {', '.join(allowed)}"
        )
    merged = {**DEFAULT_TASK_OPTIONS.get(task, {}), **(options or {})}
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in sorted(merged.items())}


def task_splits(
    task: str, options: dict[str, Any], seed: int, n_train: int, n_heldout: int
) -> tuple[list, list]:
    """(train, heldout) examples of ``task`` with resolved ``options`` (see ``resolve_task_options``)."""
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    return task_module(task).make_splits(seed, n_train, n_heldout, **kwargs)


def policy_splits(model_dir: str | Path, n_train: int | None = None) -> tuple[list, list]:
    """The (train, heldout) examples a prepared policy was fine-tuned and evaluated on.

    The RL pipeline should evaluate on this held-out list (or a prefix of it): a larger held-out
    count with the same seed would take examples that were in SFT's train split.
    """
    s = read_report(model_dir)["settings"]
    return task_splits(
        s["task"],
        s["task_options"],
        s["seed"],
        n_train or s["sft"]["train_examples"],
        s["sft"]["eval_examples"],
    )


def read_report(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / REPORT).read_text())


def policy_settings(
    task: str,
    options: dict[str, Any],
    spec: TinyModelConfig,
    sft: SftConfig,
    seed: int,
    vocab_size: int,
) -> dict[str, Any]:
    """Everything that determines the prepared weights; its hash is the cache key."""
    return {
        "format_version": FORMAT_VERSION,
        "task": task,
        "task_options": options,
        "seed": seed,
        "vocab_size": vocab_size,
        "spec": asdict(spec),
        "sft": asdict(sft),
    }


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def prepare_policy(
    out_dir: str | Path,
    *,
    task: str = "arithmetic",
    task_options: dict[str, Any] | None = None,
    spec: TinyModelConfig | None = None,
    sft: SftConfig | None = None,
    seed: int = 0,
    vocab_size: int = 512,
    progress: bool = True,
) -> Path:
    """Build, fine-tune and write the starting policy to ``out_dir``; returns ``out_dir``.

    Reuses ``out_dir`` when it holds a policy prepared with the same settings; raises
    FileExistsError when it holds anything else. Seeded: the same settings give the same weights
    (on the same torch build and thread count), and the caller's torch RNG is left alone.
    """
    out_dir = Path(out_dir)
    spec, sft = spec or TinyModelConfig(), sft or SftConfig()
    options = resolve_task_options(task, task_options)
    settings = policy_settings(task, options, spec, sft, seed, vocab_size)
    return build_and_log(
        out_dir,
        settings,
        lambda work: _fine_tune(work, settings, spec, sft, progress),
        "sft: wrote {out_dir} in {wall_s:.0f} s ({steps} steps): held-out greedy accuracy "
        "{heldout_accuracy:.3f} (train {train_accuracy:.3f}), loss {loss_first:.4f} -> {loss_final:.4f}",
    )


def build_and_log(
    out_dir: Path,
    settings: dict[str, Any],
    build: Callable[[Path], tuple[Path, dict[str, Any]]],
    summary: str,
) -> Path:
    """``build_once``, then, when it built, one log line: ``summary`` formatted with the report's fields and
    ``out_dir``. Returns ``out_dir``."""
    report = build_once(out_dir, settings, build)
    if report is not None:
        log.info("%s", summary.format(out_dir=out_dir, **report))
    return out_dir


def build_once(
    out_dir: Path, settings: dict[str, Any], build: Callable[[Path], tuple[Path, dict[str, Any]]]
) -> dict[str, Any] | None:
    """Build a prepared policy into ``out_dir`` once. None when ``out_dir`` already holds one prepared with
    ``settings`` (FileExistsError when it holds anything else); otherwise ``build(work_dir)`` returns the staged
    model directory and its report, which gets the settings, their hash and the wall time, is written beside
    the weights, and the directory is renamed into place (atomic: a crash leaves no half-written policy).
    Returns that report."""
    key = settings_hash(settings)
    if reuse_prepared(out_dir, settings, key):
        return None
    start = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(file_modes.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        staged, report = build(tmp)
        report = {
            "settings_hash": key,
            "settings": settings,
            **report,
            "wall_s": round(time.perf_counter() - start, 2),
        }
        (staged / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        try:
            staged.rename(out_dir)
        except OSError:
            # another process finished the same directory first: fine if its settings are ours
            if out_dir.exists() and reuse_prepared(out_dir, settings, key):
                return None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _fine_tune(
    work_dir: Path, settings: dict[str, Any], spec: TinyModelConfig, sft: SftConfig, progress: bool
) -> tuple[Path, dict[str, Any]]:
    """The task's splits, then tokenizer, initial model, SFT and evaluation inside ``work_dir``;
    returns (model dir, report)."""
    # imported here: the RLVR spec imports this module when a config loads, where torch may not load
    from rollhpc.warm_start.policy_build import fine_tune_on_task

    task, options, seed = settings["task"], settings["task_options"], settings["seed"]
    splits = task_splits(task, options, seed, sft.train_examples, sft.eval_examples)
    return fine_tune_on_task(
        work_dir,
        task_module(task),
        splits,
        spec,
        sft,
        seed=seed,
        vocab_size=settings["vocab_size"],
        progress=progress,
        label=f"{task} {options}",
    )


def reuse_prepared(out_dir: Path, settings: dict[str, Any], key: str) -> bool:
    """True when ``out_dir`` is a policy prepared with ``settings``; False when it does not exist."""
    if not out_dir.exists():
        return False
    report_path = out_dir / REPORT
    if not report_path.exists():
        raise FileExistsError(
            f"{out_dir} exists but is not a policy written by rollhpc (no {REPORT}); "
            "remove it or choose another directory"
        )
    recorded = json.loads(report_path.read_text())
    if recorded.get("settings_hash") == key:
        log.info("sft: reusing %s (prepared with the same settings, hash %s)", out_dir, key)
        return True
    ours, theirs = _flat(settings), _flat(recorded.get("settings", {}))
    changed = [k for k in sorted(ours.keys() | theirs.keys()) if ours.get(k) != theirs.get(k)]
    raise FileExistsError(
        f"{out_dir} holds a policy prepared with other settings (differing: {', '.join(changed)}); "
        "remove it or choose another directory"
    )


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
