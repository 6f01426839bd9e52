"""Offline checkpoint conversion: Hugging Face safetensors <-> megatron-core dist checkpoints.

``hf_to_mcore(src, dst, tp=, pp=, ep=)`` and ``mcore_to_hf(src, dst)`` for the architectures of
``rollhpc.models.megatron_gpt`` (Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE / Llama: GQA, tied or untied
embeddings, vocab padding). ``rollhpc convert`` and tools/convert_checkpoint.py call these.

Design (the choice the two directions make):

* HF -> mcore runs as a real torch.distributed world (gloo, CPU) of the target layout:
  ``pp * lcm(tp, etp*ep)`` worker processes, one per rank a trainer of that layout would have. Each
  builds its ``GPTModel`` partition (no random init), copies its shards from the HF files one tensor at
  a time (``load_hf_weights``: a tensor is read with one seek + read, cut, copied, dropped), and the
  world writes the checkpoint collectively with ``save_mcore_checkpoint`` - the function the trainer
  saves with, so megatron's own ``sharded_state_dict`` names and cuts every tensor and a converted
  checkpoint is exactly what a training run of that layout would have saved. Per process, memory is
  its partition (what ``dist_checkpointing.save`` must hold at once; written as one data file, the
  checkpoint's "shard") plus one HF tensor. Two details keep it there: megatron's writer copies every
  tensor that is a view before writing anything (the fc1 weight goes out as gate and up views: about
  half the model), so the worker hands it un-viewed pieces, releasing each parameter as it is split;
  and glibc is told to serve large blocks by mmap, so a freed tensor leaves the resident set.
* mcore -> HF runs in one process, a world of one: megatron's loader reassembles any layout, so the
  sharding arithmetic is only the TP=1 fusing (``unshard_to_hf`` of one shard). A meta-device skeleton
  gives the checkpoint's keys and shapes; the HF files' headers are planned up front; then each
  parameter is read (``dist_checkpointing.load`` of that parameter alone), unfused and streamed into
  its safetensors file. Memory: one parameter's tensors.

Every conversion runs in fresh worker processes (forked by a fork server that has imported megatron
once, so a worker starts in milliseconds); the calling process only validates the
inputs (config, tensor names, shapes, dtypes, layout divisibility: ``ConversionError`` with one clear
message) and collects each worker's report: its peak resident memory above its start-up baseline
(VmHWM after resetting it; megatron's forked file writers included) and the largest shard (largest
file on either side). Output directories are written beside the target and renamed into place.
``verify=True`` compares the logits of the HF model (transformers) and the mcore model (megatron
``GPTModel`` at TP=1 loading the checkpoint) on a few prompts, in one more worker.

Left out: pipeline parallelism with tied embeddings on CPU (megatron copies the shared embedding to
CUDA when it builds the last stage), HF ``.bin`` weights, checkpoints holding optimizer state (the
converter reads and writes model weights only).

Longer than our ~600-line rule on purpose: the three jobs (hf-to-mcore, mcore-to-hf, verify) share the job file,
the worker processes that run them and the layout checks; the command line is ``convert_cli``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rollhpc import file_modes
from rollhpc.checkpoint.mcore import (
    HF_EXTRAS_DIR,
    CheckpointError,
    copy_hf_extras,
    write_generation_config_if_missing,
)
from rollhpc.checkpoint.safetensors_io import SafetensorsDir, SafetensorsError
from rollhpc.models.megatron_gpt import (
    _hf_dict,
    arch_weight_map,
    check_hf_config,
    padded_vocab_size,
)
from rollhpc.rundir import atomic_write_json, replace_dir

# The worker fork server imports megatron; its "Transformer Engine / Apex not installed" notes are noise here.
warnings.filterwarnings(
    "ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*"
)

DEFAULT_MAX_SHARD = "2GB"
ADAPTER_DIR = (
    "adapter"  # a LoRA checkpoint's converted directory: its adapters in PEFT's format, here
)
VERIFY_PROMPTS = ("The quick brown fox jumps over", "12 + 7 = 19; 3 + 4 =", "def fibonacci(n):")


class ConversionError(RuntimeError):
    """A conversion that cannot start or did not finish; the message says why."""


@dataclass
class Report:
    direction: str
    src: str
    dst: str
    workers: int
    seconds: float = 0.0
    tensors: int = 0  # HF tensors converted
    peak_rss_bytes: int = 0  # largest worker's peak resident memory above its baseline
    baseline_rss_bytes: int = (
        0  # that worker's resident memory before the conversion (imports, world)
    )
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
        text = (
            f"{self.direction}: {self.tensors} tensors, {self.workers} worker(s), {self.seconds:.1f} s; "
            f"peak memory {_mib(self.peak_rss_bytes)} above a {_mib(self.baseline_rss_bytes)} baseline = "
            f"{ratio:.2f} x the largest shard ({_mib(self.largest_shard_bytes)}, {Path(self.largest_shard).name})"
        )
        if self.verify:
            v = self.verify
            text += (
                f"; verify: max |logit diff| {v['max_abs_diff']:.2e} over {v['prompts']} prompts "
                f"({'ok' if v['ok'] else 'FAILED'}, atol {v['atol']:g})"
            )
        return text


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


# ------------------------------------------------------------------ validation (calling process)


def expected_hf_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF checkpoint of this config.json and its shape (``lm_head.weight`` only when
    untied)."""
    cfg = _hf_dict(hf_config)
    arch = check_hf_config(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nh
    d = cfg.get("head_dim") or h // nh
    ffn = {
        "": cfg.get("intermediate_size"),
        "experts": cfg.get("moe_intermediate_size"),
        "shared_expert": cfg.get("shared_expert_intermediate_size"),
    }
    fixed = {
        "q_proj.weight": (nh * d, h),
        "k_proj.weight": (ng * d, h),
        "v_proj.weight": (ng * d, h),
        "q_proj.bias": (nh * d,),
        "k_proj.bias": (ng * d,),
        "v_proj.bias": (ng * d,),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "o_proj.weight": (h, nh * d),
        "mlp.gate.weight": (arch.num_experts, h),
        "shared_expert_gate.weight": (1, h),
    }
    shapes = {}
    for w in arch_weight_map(arch):
        for name in w.hf:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                shapes[name] = (v, h)
            elif name.endswith("norm.weight") and not name.endswith(
                ("q_norm.weight", "k_norm.weight")
            ):
                shapes[name] = (h,)
            elif (key := next((k for k in fixed if name.endswith(k)), None)) is not None:
                shapes[name] = fixed[key]
            else:  # gate_proj / up_proj / down_proj of the dense MLP, a routed expert or the shared expert
                kind = (
                    "experts"
                    if ".mlp.experts." in name
                    else "shared_expert"
                    if ".shared_expert." in name
                    else ""
                )
                f = ffn[kind]
                shapes[name] = (h, f) if name.endswith("down_proj.weight") else (f, h)
    return shapes


def check_hf_dir(src: Path) -> tuple[dict[str, Any], SafetensorsDir, torch.dtype]:
    """(config, tensors, dtype) of an HF model directory after checking it can be converted: supported
    architecture, every tensor present with the shape config.json implies, nothing unexpected, one dtype."""
    if not src.is_dir():
        raise ConversionError(f"{src}: no such directory")
    if not (src / "config.json").is_file():
        hint = (
            " (it looks like a megatron checkpoint: use mcore-to-hf)"
            if (src / "metadata.json").is_file()
            else ""
        )
        raise ConversionError(
            f"{src} is not a Hugging Face model directory: config.json is missing{hint}"
        )
    try:
        cfg = json.loads((src / "config.json").read_text())
    except ValueError as e:
        raise ConversionError(f"{src / 'config.json'}: not valid JSON ({e})") from e
    try:
        expected = expected_hf_shapes(cfg)
    except NotImplementedError as e:
        raise ConversionError(f"unsupported architecture in {src / 'config.json'}: {e}") from e
    except KeyError as e:
        raise ConversionError(f"{src / 'config.json'} lacks {e}") from e
    try:
        tensors = SafetensorsDir(src)
    except SafetensorsError as e:
        raise ConversionError(f"cannot read the weights of {src}: {e}") from e
    tied = bool(cfg.get("tie_word_embeddings", False))
    missing = sorted(set(expected) - set(tensors.info))
    unexpected = sorted(
        n
        for n in tensors.info
        if n not in expected
        and not (tied and n == "lm_head.weight")
        and not n.endswith("rotary_emb.inv_freq")
    )
    if missing:
        raise ConversionError(
            f"{src}: missing {len(missing)} tensor(s) a {cfg.get('model_type')} model of this "
            f"config.json has: {_few(missing)}"
        )
    if unexpected:
        raise ConversionError(
            f"{src}: {len(unexpected)} unexpected tensor(s) (not part of a {cfg.get('model_type')} "
            f"model of this config.json): {_few(unexpected)}"
        )
    wrong = [
        f"{n}: checkpoint {list(tensors.info[n].shape)}, config.json implies {list(s)}"
        for n, s in expected.items()
        if tensors.info[n].shape != s
    ]
    if wrong:
        raise ConversionError(
            f"{src}: shape mismatch for {len(wrong)} tensor(s): {'; '.join(wrong[:4])}"
        )
    dtypes = {tensors.info[n].dtype for n in expected}
    if len(dtypes) != 1:
        raise ConversionError(
            f"{src}: mixed dtypes {sorted(map(str, dtypes))}; convert the weights to one dtype first"
        )
    return cfg, tensors, dtypes.pop()


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" ... ({len(names) - n} more)" if len(names) > n else "")


def check_layout(hf_config: Any, tp: int, pp: int, ep: int, etp: int | None) -> int:
    """The world size for this layout, after checking that the model divides over it."""
    cfg = _hf_dict(hf_config)
    arch = check_hf_config(cfg)
    etp = tp if etp is None else etp
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp)):
        if not isinstance(value, int) or value < 1:
            raise ConversionError(f"--{name} must be a positive integer, got {value!r}")
    nh = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nh
    checks = [
        (nh % tp == 0, f"num_attention_heads={nh} is not divisible by tp={tp}"),
        (ng % tp == 0, f"num_key_value_heads={ng} is not divisible by tp={tp}"),
        (
            arch.num_layers % pp == 0,
            f"num_hidden_layers={arch.num_layers} is not divisible by pp={pp}",
        ),
    ]
    if arch.num_experts:
        f = cfg["moe_intermediate_size"]
        checks += [
            (
                arch.num_experts % ep == 0,
                f"num_experts={arch.num_experts} is not divisible by ep={ep}",
            ),
            (f % etp == 0, f"moe_intermediate_size={f} is not divisible by etp={etp}"),
        ]
        if arch.shared_expert:
            fs = cfg["shared_expert_intermediate_size"]
            checks.append(
                (fs % tp == 0, f"shared_expert_intermediate_size={fs} is not divisible by tp={tp}")
            )
    else:
        checks += [
            (
                ep == 1,
                f"ep={ep}: expert parallelism needs a MoE model ({cfg.get('model_type')} is dense)",
            ),
            (
                cfg["intermediate_size"] % tp == 0,
                f"intermediate_size={cfg['intermediate_size']} is not divisible by tp={tp}",
            ),
        ]
    if pp > 1 and arch.tie_word_embeddings and not torch.cuda.is_available():
        checks.append(
            (
                False,
                f"pp={pp} with tied embeddings needs CUDA (megatron copies the shared embedding to "
                "the GPU when it builds the last stage): use pp=1 (the checkpoint loads at any pp)",
            )
        )
    bad = [msg for ok, msg in checks if not ok]
    if bad:
        raise ConversionError(
            f"layout tp={tp} pp={pp} ep={ep} etp={etp} does not fit the model: {'; '.join(bad)}"
        )
    return pp * math.lcm(tp, etp * ep)


def _check_dst(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not overwrite:
        raise ConversionError(f"{dst} exists; pass --overwrite to replace it")


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
    cfg, tensors, dtype = check_hf_dir(src)
    world = check_layout(cfg, tp, pp, ep, etp)
    _check_dst(dst, overwrite)
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
    t0 = time.perf_counter()
    try:
        results = run_workers(job, world)
    except ConversionError:
        # save_mcore_checkpoint's
        shutil.rmtree(dst.parent / f".{dst.name}.partial", ignore_errors=True)
        raise
    report.seconds = time.perf_counter() - t0
    report.tensors = len(tensors)
    _fill_memory(report, results)
    shards = [tensors.largest_file()] + [(p, p.stat().st_size) for p in dst.glob("*.distcp")]
    path, size = max(shards, key=lambda x: x[1])
    report.largest_shard, report.largest_shard_bytes = str(path), size
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
    t0 = time.perf_counter()
    (result,) = run_workers(job, 1)
    report.seconds = time.perf_counter() - t0
    report.tensors = result["tensors"]
    _fill_memory(report, [result])
    shards = [
        (p, p.stat().st_size) for p in list(src.glob("*.distcp")) + list(dst.glob("*.safetensors"))
    ]
    path, size = max(shards, key=lambda x: x[1])
    report.largest_shard, report.largest_shard_bytes = str(path), size
    if verify:
        report.verify = verify_logits(dst, src)
    return report


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
    cfg, _, _ = check_hf_dir(Path(src).absolute())
    world = check_layout(cfg, tp, pp, ep, etp)
    _check_dst(Path(dst).absolute(), overwrite)
    return world


def check_mcore_to_hf(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> None:
    """Everything ``mcore_to_hf`` checks before it starts (file sizes, not checksums: the worker reads them)."""
    from rollhpc.checkpoint.mcore import read_metadata

    src = Path(src).absolute()
    try:
        meta = read_metadata(src, checksums=False)
        check_hf_config(meta["hf_config"])
    except CheckpointError as e:
        raise ConversionError(str(e)) from e
    except NotImplementedError as e:
        raise ConversionError(f"unsupported architecture in {src}: {e}") from e
    _check_dst(Path(dst).absolute(), overwrite)


def _check_verify_deps() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConversionError("--verify needs transformers (pip install transformers)") from e


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


def _fill_memory(report: Report, results: list[dict[str, Any]]) -> None:
    report.per_worker = results
    top = max(results, key=lambda r: r["peak_rss_bytes"])
    report.peak_rss_bytes, report.baseline_rss_bytes = (
        top["peak_rss_bytes"],
        top["baseline_rss_bytes"],
    )


# ------------------------------------------------------------------ worker processes


def run_workers(job: dict[str, Any], nprocs: int) -> list[dict[str, Any]]:
    """Run ``job`` in ``nprocs`` worker processes (one torch.distributed world); their result dicts by
    rank. A failing worker stops the others; its message becomes a ``ConversionError`` (the first clear
    one: a worker that fails because another one died says less)."""
    import multiprocessing

    import torch.multiprocessing as mp

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
            errors = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("error-*.json"))]
            if errors:
                first = next((err for err in errors if err["clear"]), errors[0])
                raise ConversionError(first["message"]) from None
            raise ConversionError(
                f"a conversion worker died: {type(e).__name__}: {str(e).strip()[-2000:]}"
            ) from e
        return [json.loads((Path(tmp) / f"result-{r}.json").read_text()) for r in range(nprocs)]


_PRELOAD = (
    "rollhpc.conversion.convert",
    "rollhpc.checkpoint.mcore",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
)


_CLEAR_ERRORS = (
    ConversionError,
    CheckpointError,
    SafetensorsError,
    KeyError,
    ValueError,
    NotImplementedError,
    FileExistsError,
    FileNotFoundError,
)


def _fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """glibc: serve every allocation above ``nbytes`` by mmap, returned to the system when freed. By
    default the threshold grows with the blocks freed, so the tensors read one after the other end up
    on the heap, which does not shrink: the resident set would keep the largest ones long after."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _worker(rank: int, job: dict[str, Any], out: str) -> None:
    # megatron's "Transformer Engine / apex not installed" and the like
    warnings.simplefilter("ignore")
    torch.set_num_threads(job["threads"])
    _fixed_mmap_threshold()
    try:
        body = {
            "hf_to_mcore": _hf_to_mcore_rank,
            "mcore_to_hf": _mcore_to_hf_rank,
            "verify": _verify_rank,
        }[job["kind"]]
        result = body(rank, job)
    except BaseException as e:
        message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if not isinstance(e, _CLEAR_ERRORS):  # unexpected: keep the traceback
            message = f"{type(e).__name__}: {message}\n{traceback.format_exc()}"
        clear = isinstance(e, _CLEAR_ERRORS)
        Path(out, f"error-{rank}.json").write_text(json.dumps({"message": message, "clear": clear}))
        raise
    atomic_write_json(Path(out, f"result-{rank}.json"), result)


def _memory(baseline: int) -> dict[str, int]:
    own, children = peak_rss_bytes(), children_peak_rss_bytes()
    return {
        "peak_rss_bytes": max(0, max(own, children) - baseline),
        "baseline_rss_bytes": baseline,
        "own_peak_rss_bytes": own,
        "children_peak_rss_bytes": children,
    }


def _hf_to_mcore_rank(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=job["rendezvous"],
        rank=rank,
        world_size=job["world"],
        timeout=timedelta(hours=2),
    )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rollhpc.checkpoint.mcore import save_mcore_checkpoint
    from rollhpc.models import megatron_cpu
    from rollhpc.models.megatron_gpt import build_gpt_model, load_hf_weights, model_weight_map

    megatron_cpu.enable_cpu_megatron()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=job["tp"],
        pipeline_model_parallel_size=job["pp"],
        expert_model_parallel_size=job["ep"],
        expert_tensor_parallel_size=job["etp"],
    )
    model_parallel_cuda_manual_seed(0)
    src = Path(job["src"])
    cfg = json.loads((src / "config.json").read_text())
    baseline = rss_bytes()
    reset_peak_rss()
    model = build_gpt_model(
        cfg,
        params_dtype=getattr(torch, job["dtype"]),
        padded_vocab=job["padded_vocab"],
        perform_initialization=False,
    )
    model.requires_grad_(False)
    table, _ = model_weight_map(model)
    bar = Progress(
        sum(len(w.hf) for w in table),
        f"rank {rank}: reading {src.name}",
        enabled=job["progress"] and rank == 0,
    )
    load_hf_weights(
        model,
        _Ticking(SafetensorsDir(src), bar),
        parallel_state.get_tensor_model_parallel_rank(),
        job["tp"],
    )
    bar.close()
    if job["progress"] and rank == 0:
        _log(f"writing the megatron checkpoint ({job['world']} rank(s)) to {job['dst']}")
    layout = dict(source=str(src), converted_by="rollhpc convert hf-to-mcore")
    save_mcore_checkpoint(
        model,
        job["dst"],
        src,
        layout,
        overwrite=job["overwrite"],
        checksums=True,
        sharded_state_dict=_sharded_without_views(model),
    )
    result = _memory(baseline)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def _sharded_without_views(model: torch.nn.Module) -> dict[str, Any]:
    """``model.sharded_state_dict()`` with its factories applied and no tensor a view of a larger one.

    megatron's writer copies every view before writing any file (the fc1 weight is split into gate and
    up views: about half the model's bytes copied at once). Here each such parameter is copied into its
    pieces and then released, one parameter at a time, so the save holds the partition once. The model
    is unusable afterwards (released parameters are empty)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    by_storage: dict[int, list[Any]] = {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and sh.data is not None:
            storage = sh.data.untyped_storage()
            if storage.nbytes() != sh.data.numel() * sh.data.element_size():
                by_storage.setdefault(storage.data_ptr(), []).append(sh)
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    for ptr, pieces in by_storage.items():
        for sh in pieces:
            sh.data = sh.data.clone()
        if ptr in params:
            params[ptr].data = torch.empty(0, dtype=params[ptr].dtype)
    return sd


def _mcore_to_hf_rank(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    from rollhpc.checkpoint.mcore import McoreReader, single_process_world
    from rollhpc.checkpoint.safetensors_io import PlannedTensor, SafetensorsWriter
    from rollhpc.models.megatron_gpt import hf_arch, unshard_to_hf

    src, dst = Path(job["src"]), Path(job["dst"])
    with single_process_world():
        baseline = rss_bytes()
        reset_peak_rss()
        reader = McoreReader(src, checksums=job["checksums"])
        cfg = reader.hf_config
        table = arch_weight_map(hf_arch(cfg))
        skeleton = dict(reader.skeleton.named_parameters())
        kw = dict(
            num_query_groups=reader.skeleton.config.num_query_groups,
            num_attention_heads=reader.skeleton.config.num_attention_heads,
            vocab_size=reader.vocab_size,
        )
        plan = [
            PlannedTensor(name, t.dtype, tuple(t.shape))
            for w in table
            for name, t in unshard_to_hf(w.layout, [skeleton[w.megatron]], w.hf, **kw).items()
        ]
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(file_modes.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
        try:
            writer = SafetensorsWriter(tmp, plan, job["max_shard_bytes"])
            bar = Progress(len(table), f"writing {dst.name}", enabled=job["progress"])
            for w in table:
                full = reader.read([w.megatron])[w.megatron]
                # a LoRA checkpoint: its adapters merged in (W + alpha/r B A)
                if reader.lora is not None:
                    full = _merged(reader, w.megatron, full)
                for name, tensor in unshard_to_hf(w.layout, [full], w.hf, **kw).items():
                    writer.write(name, tensor)
                del full
                bar.update()
            bar.close()
            writer.close()
            if reader.lora is not None:
                _write_peft_adapter(reader, tmp / ADAPTER_DIR)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            if (src / HF_EXTRAS_DIR).is_dir():
                copy_hf_extras(src / HF_EXTRAS_DIR, tmp)
            # as save_pretrained would have: vLLM reads its EOS
            write_generation_config_if_missing(tmp, cfg)
            _replace(tmp, dst, job["overwrite"])
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {**_memory(baseline), "tensors": len(plan)}


def _write_peft_adapter(reader: Any, out: Path) -> None:
    """A LoRA checkpoint's adapters as a PEFT adapter directory (adapter_model.safetensors, adapter_config.json):
    what `PeftModel.from_pretrained(base, out)` loads onto the base model the run started from."""
    from safetensors.torch import save_file

    from rollhpc.models.lora import LORA_ATTRIBUTE, peft_config, peft_tensors

    c = reader.skeleton.config
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(c.num_layers):
        for target in reader.lora.target:
            prefix = f"decoder.layers.{layer}.{LORA_ATTRIBUTE}.{target}."
            ab = reader.read([prefix + "lora_a", prefix + "lora_b"])
            tensors.update(
                peft_tensors(
                    layer,
                    target,
                    ab[prefix + "lora_a"],
                    [ab[prefix + "lora_b"]],
                    c.num_query_groups,
                    c.num_attention_heads,
                )
            )
    out.mkdir()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors")
    )
    (out / "adapter_config.json").write_text(
        json.dumps(peft_config(reader.lora), indent=2, sort_keys=True) + "\n"
    )


def _merged(reader: Any, name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (a full megatron tensor of ``reader``'s checkpoint) with its LoRA adapter merged in, when it has
    one: in megatron's layout, B's rows being the weight's (fused q/k/v, gate/up), before any split."""
    from rollhpc.models.lora import adapter_of

    names = adapter_of(name, reader.lora)
    if names is None:
        return weight
    ab = reader.read(list(names))
    a, b = ab[names[0]].float(), ab[names[1]].float()
    return (weight.float() + reader.lora.scaling * (b @ a)).to(weight.dtype)


def _replace(tmp: Path, dst: Path, overwrite: bool) -> None:
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
    replace_dir(tmp, dst)


def _verify_rank(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rollhpc.checkpoint.mcore import load_mcore_checkpoint, read_metadata, single_process_world
    from rollhpc.models.megatron_gpt import build_gpt_model

    hf_logging.disable_progress_bar()
    hf_dir, mcore_dir = Path(job["hf_dir"]), Path(job["mcore_dir"])
    with single_process_world():
        meta = read_metadata(mcore_dir, checksums=False)
        cfg = meta["hf_config"]
        # Both models in float32 (bf16/fp16 weights upcast exactly), so only the arithmetic differs.
        model = build_gpt_model(
            cfg,
            tp=1,
            params_dtype=torch.float32,
            parallel_output=False,
            padded_vocab=meta["padded_vocab_size"],
            perform_initialization=False,
        )
        load_mcore_checkpoint(model, mcore_dir)
        model.eval()
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        prompts = _verify_prompts(hf_dir, cfg["vocab_size"])
        diffs, agree = [], 0.0
        with torch.no_grad():
            for ids in prompts:
                ids = torch.tensor([ids])
                ours = model(ids, torch.arange(ids.shape[1])[None], None)[..., : cfg["vocab_size"]]
                ref = hf(ids).logits
                diffs.append((ours - ref).abs().max().item())
                agree += (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() / len(prompts)
    atol = job["atol"] if job["atol"] is not None else 1e-3
    worst = max(diffs)
    return {
        "verify": {
            "max_abs_diff": worst,
            "per_prompt": diffs,
            "prompts": len(prompts),
            "atol": atol,
            "argmax_agree": agree,
            "ok": worst <= atol,
        }
    }


def _verify_prompts(hf_dir: Path, vocab: int) -> list[list[int]]:
    """Token ids of VERIFY_PROMPTS with the model's tokenizer, or fixed pseudo-random ids without one."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        prompts = [tok(p)["input_ids"] for p in VERIFY_PROMPTS]
        if all(prompts) and all(0 <= i < vocab for p in prompts for i in p):
            return prompts
    except (OSError, ValueError, KeyError, TypeError):
        pass
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 16)]


# ------------------------------------------------------------------ memory


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 elsewhere)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set (VmHWM), or ru_maxrss where /proc lacks it."""
    kib = _status_kib("VmHWM")
    if kib:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, writing 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children_peak_rss_bytes() -> int:
    """Largest peak RSS of this process's waited-for children (megatron's forked checkpoint writers)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


# ------------------------------------------------------------------ progress


def _log(text: str) -> None:
    print(f"rollhpc convert: {text}", file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar on a terminal; on a log (Slurm), a line per 10%."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled, self.done, self._shown = total, desc, enabled, 0, 0
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self.total:
            tenth = self.done * 10 // self.total
            if tenth != self._shown:
                self._shown = tenth
                _log(f"{self.desc}: {self.done}/{self.total} ({100 * self.done // self.total}%)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Ticking(Mapping):
    """A Mapping over a SafetensorsDir that advances a progress bar at every tensor read."""

    def __init__(self, tensors: SafetensorsDir, bar: Progress):
        self.tensors, self.bar = tensors, bar

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        self.bar.update()
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def report_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=1)
