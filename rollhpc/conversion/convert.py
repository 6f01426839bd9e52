"""Offline checkpoint conversion: Hugging Face safetensors <-> megatron-core dist checkpoints.

``hf_to_mcore(src, dst, tp=, pp=, ep=)`` and ``mcore_to_hf(src, dst)`` for the architectures of
``rollhpc.models.megatron_gpt`` (Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE / Llama: GQA, tied or untied
embeddings, vocab padding). ``rollhpc convert`` and tools/convert_checkpoint.py call these.

Design (the choice the two directions make):

* HF -> mcore runs as a real torch.distributed world (gloo, CPU) of the target layout:
  ``pp * lcm(tp, etp*ep)`` worker processes, one per rank a trainer of that layout would have
  (``to_mcore``). Each builds its ``GPTModel`` partition and copies its shards from the HF files one tensor
  at a time, and the world writes the checkpoint collectively with ``save_mcore_checkpoint`` - the function
  the trainer saves with, so megatron's own ``sharded_state_dict`` names and cuts every tensor and a converted
  checkpoint is exactly what a training run of that layout would have saved. Per process, memory is
  its partition (what ``dist_checkpointing.save`` must hold at once; written as one data file, the
  checkpoint's "shard") plus one HF tensor. Two details keep it there: megatron's writer copies every
  tensor that is a view before writing anything (the fc1 weight goes out as gate and up views: about
  half the model), so the worker hands it un-viewed pieces, releasing each parameter as it is split;
  and glibc is told to serve large blocks by mmap, so a freed tensor leaves the resident set.
* mcore -> HF runs in one process, a world of one (``to_hf``): megatron's loader reassembles any layout,
  and each parameter is read alone, unfused and streamed into its safetensors file. Memory: one
  parameter's tensors.

Every conversion runs in fresh worker processes (``worker``, forked by a fork server that has imported
megatron once, so a worker starts in milliseconds); the calling process imports no megatron: it only
validates the inputs (``checks``: config, tensor names, shapes, dtypes, layout divisibility) and collects
each worker's report: its peak resident memory above its start-up baseline (VmHWM after resetting it;
megatron's forked file writers included) and the largest shard (largest file on either side). Output
directories are written beside the target and renamed into place. ``verify=True`` compares the logits of
the HF model (transformers) and the mcore model on a few prompts, in one more worker (``verify``).

Left out: pipeline parallelism with tied embeddings on CPU (megatron copies the shared embedding to
CUDA when it builds the last stage), HF ``.bin`` weights, checkpoints holding optimizer state (the
converter reads and writes model weights only).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from rollhpc.checkpoint.mcore_files import CheckpointError, read_metadata
from rollhpc.checkpoint.safetensors_io import SafetensorsDir
from rollhpc.conversion.checks import (
    ConversionError,
    check_dst,
    check_hf_dir,
    check_layout,
)
from rollhpc.models.hf_weight_map import check_hf_config, padded_vocab_size

# The worker fork server imports megatron; its "Transformer Engine / Apex not installed" notes are noise here.
warnings.filterwarnings(
    "ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*"
)

DEFAULT_MAX_SHARD = "2GB"
# what the fork server imports once, so that each worker it forks starts with megatron loaded
_PRELOAD = ("rollhpc.conversion.convert", "rollhpc.conversion.worker")


@dataclass
class Report:
    """What a conversion did: its time, size and memory, and the logit comparison with ``verify``."""

    direction: str
    src: str
    dst: str
    workers: int
    seconds: float = 0.0
    tensors: int = 0  # HF tensors converted
    peak_rss_bytes: int = 0  # largest worker's peak resident memory above its baseline
    # that worker's resident memory before the conversion (imports, world)
    baseline_rss_bytes: int = 0
    largest_shard_bytes: int = 0
    largest_shard: str = ""
    verify: dict[str, Any] | None = None
    per_worker: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        ratio = (
            self.peak_rss_bytes / self.largest_shard_bytes
            if self.largest_shard_bytes
            else float("nan")
        )
        return (
            f"{self.direction}: {self.tensors} tensors, {self.workers} worker(s), {self.seconds:.1f} s; "
            f"peak memory {_mib(self.peak_rss_bytes)} above a {_mib(self.baseline_rss_bytes)} baseline = "
            f"{ratio:.2f} x the largest shard ({_mib(self.largest_shard_bytes)}, {Path(self.largest_shard).name})"
            f"{self.verify_summary()}"
        )

    def json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def verify_summary(self) -> str:
        """'; verify: max |logit diff| ... (ok, atol ...)' after a verified conversion, else ''."""
        if not self.verify:
            return ""
        v = self.verify
        return (
            f"; verify: max |logit diff| {v['max_abs_diff']:.2e} over {v['prompts']} prompts "
            f"({'ok' if v['ok'] else 'FAILED'}, atol {v['atol']:g})"
        )

    def record_largest_shard(self, files: Iterable[Path]) -> None:
        sizes = [(p, p.stat().st_size) for p in files]
        path, size = max(sizes, key=lambda x: x[1])
        self.largest_shard, self.largest_shard_bytes = str(path), size

    def record_workers(self, results: list[dict[str, Any]]) -> None:
        """Each worker's report, and the memory of the one with the highest peak."""
        self.per_worker = results
        top = max(results, key=lambda r: r["peak_rss_bytes"])
        self.peak_rss_bytes = top["peak_rss_bytes"]
        self.baseline_rss_bytes = top["baseline_rss_bytes"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def parse_size(text: str | int) -> int:
    """``"2GB"``, ``"500MB"``, ``"64KiB"`` or an int -> bytes (GB = 10^9, GiB = 2^30, as transformers)."""
    if isinstance(text, int):
        return text
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    s = str(text).strip().upper()
    num = s.rstrip("KMGTIB")
    try:
        value = float(num) * units[s[len(num) :]]
    except (KeyError, ValueError):
        raise ValueError(
            f"size {text!r}: expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)"
        )
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return int(value)


# ------------------------------------------------------------------ entry points


def hf_to_mcore(
    src: str | Path,
    dst: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
) -> Report:
    """Convert the HF model directory ``src`` into a megatron dist checkpoint ``dst`` saved at layout
    tp/pp/ep/etp (etp defaults to tp, as in megatron); the checkpoint loads at any layout."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    cfg, tensors, dtype, world = _checked_hf_inputs(src, dst, tp, pp, ep, etp, overwrite)
    if verify:
        _check_verify_deps()
    job = dict(
        kind="hf_to_mcore",
        src=str(src),
        dst=str(dst),
        tp=tp,
        pp=pp,
        ep=ep,
        etp=tp if etp is None else etp,
        dtype=str(dtype).removeprefix("torch."),
        padded_vocab=padded_vocab_size(cfg["vocab_size"], tp),
        overwrite=overwrite,
        progress=progress,
    )
    report = Report("hf-to-mcore", str(src), str(dst), world)
    try:
        _run_into(report, job)
    except ConversionError:
        # the partial directory save_mcore_checkpoint writes before renaming it into place
        shutil.rmtree(dst.parent / f".{dst.name}.partial", ignore_errors=True)
        raise
    report.tensors = len(tensors)
    largest_hf = tensors.largest_file()[0]
    report.record_largest_shard([largest_hf, *dst.glob("*.distcp")])
    if verify:
        report.verify = verify_logits(src, dst)
    return report


def mcore_to_hf(
    src: str | Path,
    dst: str | Path,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
    checksums: bool = True,
) -> Report:
    """Convert the megatron dist checkpoint ``src`` (any layout) into an HF model directory ``dst``
    (safetensors files of at most ``max_shard_size``, config.json, the checkpoint's ``hf/`` files: tokenizer,
    generation_config.json, or one derived from config.json when the source had none). ``checksums``: check
    the files' sha256 first."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    check_mcore_to_hf(src, dst, overwrite=overwrite)
    if verify:
        _check_verify_deps()
    job = dict(
        kind="mcore_to_hf",
        src=str(src),
        dst=str(dst),
        max_shard_bytes=parse_size(max_shard_size),
        overwrite=overwrite,
        progress=progress,
        checksums=checksums,
    )
    report = Report("mcore-to-hf", str(src), str(dst), 1)
    (result,) = _run_into(report, job)
    report.tensors = result["tensors"]
    report.record_largest_shard([*src.glob("*.distcp"), *dst.glob("*.safetensors")])
    if verify:
        report.verify = verify_logits(dst, src)
    return report


def _run_into(report: Report, job: dict[str, Any]) -> list[dict[str, Any]]:
    """``job`` run by ``report.workers`` workers, their time and memory recorded in ``report``."""
    t0 = time.perf_counter()
    results = run_workers(job, report.workers)
    report.seconds = time.perf_counter() - t0
    report.record_workers(results)
    return results


def check_hf_to_mcore(
    src: str | Path,
    dst: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    overwrite: bool = False,
) -> int:
    """Everything ``hf_to_mcore`` checks before it starts; returns the number of worker processes."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    return _checked_hf_inputs(src, dst, tp, pp, ep, etp, overwrite)[3]


def _checked_hf_inputs(
    src: Path, dst: Path, tp: int, pp: int, ep: int, etp: int | None, overwrite: bool
) -> tuple[dict[str, Any], SafetensorsDir, torch.dtype, int]:
    """(config, tensors, dtype, world size) of an HF -> mcore conversion whose inputs pass every check."""
    cfg, tensors, dtype = check_hf_dir(src)
    world = check_layout(cfg, tp, pp, ep, etp)
    check_dst(dst, overwrite)
    return cfg, tensors, dtype, world


def check_mcore_to_hf(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> None:
    """Everything ``mcore_to_hf`` checks before it starts (file sizes, not checksums: the worker reads them)."""
    src = Path(src).absolute()
    try:
        meta = read_metadata(src, checksums=False)
        check_hf_config(meta["hf_config"])
    except CheckpointError as e:
        raise ConversionError(str(e)) from e
    except NotImplementedError as e:
        raise ConversionError(f"unsupported architecture in {src}: {e}") from e
    check_dst(Path(dst).absolute(), overwrite)


def _check_verify_deps() -> None:
    """The logit comparison needs transformers; it is looked for here, and loaded only by its worker."""
    if importlib.util.find_spec("transformers") is None:
        raise ConversionError("--verify needs transformers (pip install transformers)")


def verify_logits(
    hf_dir: str | Path, mcore_dir: str | Path, *, atol: float | None = None
) -> dict[str, Any]:
    """Logits of the HF model (transformers) and of the megatron model loading the mcore checkpoint on a
    few prompts, in one worker process: ``{"max_abs_diff", "prompts", "atol", "ok", "argmax_agree"}``."""
    job = dict(
        kind="verify",
        hf_dir=str(Path(hf_dir).absolute()),
        mcore_dir=str(Path(mcore_dir).absolute()),
        atol=atol,
    )
    (result,) = run_workers(job, 1)
    return result["verify"]


# ------------------------------------------------------------------ worker processes


def run_workers(job: Mapping[str, Any], nprocs: int) -> list[dict[str, Any]]:
    """Run ``job`` in ``nprocs`` worker processes (one torch.distributed world); their result dicts by
    rank. A failing worker stops the others; its message becomes a ``ConversionError`` (the first clear
    one: a worker that fails because another one died says less)."""
    # A fork server that has imported megatron once forks every worker: a worker then starts in
    # milliseconds instead of re-importing torch + megatron (seconds each), and the calling process
    # (which may hold threads or a CUDA context) is never forked itself.
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
    with tempfile.TemporaryDirectory(prefix="rollhpc-convert-") as tmp:
        # the workers meet through a file of this directory: no port to pick that another process could take first
        job = {
            **job,
            "rendezvous": f"file://{tmp}/rendezvous",
            "world": nprocs,
            "threads": max(1, (os.cpu_count() or 1) // nprocs),
        }
        try:
            mp.start_processes(
                _worker, args=(job, tmp), nprocs=nprocs, join=True, start_method="forkserver"
            )
        except Exception as e:  # noqa: BLE001 - the workers' own reports say what went wrong
            reported = _reported_error(Path(tmp))
            if reported is not None:
                raise ConversionError(reported) from None
            raise ConversionError(
                f"a conversion worker died: {type(e).__name__}: {str(e).strip()[-2000:]}"
            ) from e
        return [json.loads((Path(tmp) / f"result-{r}.json").read_text()) for r in range(nprocs)]


def _reported_error(tmp: Path) -> str | None:
    """The message of the first clear error the workers reported, else of the first one; None if none did."""
    errors = [json.loads(p.read_text()) for p in sorted(tmp.glob("error-*.json"))]
    if not errors:
        return None
    return next((err for err in errors if err["clear"]), errors[0])["message"]


def _worker(rank: int, job: Mapping[str, Any], out: str) -> None:
    """A worker process's entry, pickled by name. Its modules import megatron (and the verify worker's,
    transformers) at their top: importing them here keeps both out of the calling process (a login node's
    ``rollhpc convert --check``, the controller exporting at a run's end)."""
    from rollhpc.conversion import worker

    worker.run(rank, job, out)
