"""What a vLLM engine sets in its process before it starts (``rollhpc.engines.vllm_engine`` calls
``prepare_process``): where its engine core runs, what that engine core may unpickle, how vLLM's CPU workers
share this process's cores, and what shortens every start (the imported heap frozen, the sampler's one compiled
op eager on CPU, the chat-template warm-up's failure kept out of the log).
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import vllm.envs as vllm_envs
from vllm.v1.sample import sampler

from rollhpc.engines.vllm_choices import VllmChoices

__all__ = [
    "engine_core_takes_pickles",
    "let_engine_core_unpickle",
    "log_choices",
    "prepare_process",
]

log = logging.getLogger(__name__)


def prepare_process(separate_process: bool, on_cpu: bool, worker_processes: int) -> None:
    """Everything an engine start needs set in this process first, in order. ``worker_processes``: how many
    processes of its own vLLM starts for its workers (0: they run in the engine core's process)."""
    set_engine_process(separate_process)
    freeze_imported_heap()
    quiet_chat_template_warmup()
    if on_cpu:
        eager_token_ranks_on_cpu()
        if worker_processes:
            bind_cpu_workers(worker_processes)


def set_engine_process(separate: bool) -> None:
    """Put vLLM's engine core in this process or in its own (``VLLM_ENABLE_V1_MULTIPROCESSING``, read by
    ``LLMEngine.from_engine_args``), and check that vLLM sees it: an in-process engine core caches vLLM's whole
    environment when it starts (``vllm.envs.enable_envs_cache`` in ``EngineCore.__init__``), after which a later
    engine of this process could no longer change it and would silently run in the first one's mode."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate else "0"
    if bool(vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING) != separate:
        raise RuntimeError(
            f"engine_process={'separate' if separate else 'same'}: an earlier vLLM engine of this "
            "process ran with the other mode and vLLM has cached its environment since; one mode per "
            "process (set engine_process alike for every engine of a process)"
        )


def engine_core_takes_pickles(
    separate_process: bool, weight_transfer: str | None, cpu_moe: bool
) -> str | None:
    """Why this engine sends its engine core what vLLM's message encoder takes only through pickle, or None.

    A separate engine core is reached through msgpack (vllm/v1/serial_utils.py), which refuses anything but plain
    data and tensors unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 (MsgpackEncoder.enc_hook; the engine core's decoder
    checks it as well). Two of this engine's messages are not plain: the CUDA-IPC weight transfer's handles
    (torch.multiprocessing's rebuild arguments hold a storage class, a dtype and a device), and on CPU a MoE
    model's expert repack after each weight update (a function: vllm_cpu_moe_repack). In one process, or with
    the CPU's shared-memory transfer (names, offsets, a segment name), nothing needs pickle."""
    if not separate_process:
        return None
    if weight_transfer == "ipc":
        return "the CUDA-IPC weight transfer's handles (rebuild arguments with a dtype, a device, a class)"
    if cpu_moe:
        return "a MoE model's expert repack after each weight update on CPU (a function)"
    return None


def let_engine_core_unpickle(why: str) -> None:
    """Let this process's own engine core take pickled messages (VLLM_ALLOW_INSECURE_SERIALIZATION=1, inherited by
    the engine core's process), unless the user said no: then refuse at start rather than at the first weight
    sync. Pickle is vLLM's concern for sockets that others may reach; here the peer is this process's child,
    on a local IPC socket of this user."""
    value = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    if value is None:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        log.info(
            "vLLM engine core in its own process: VLLM_ALLOW_INSECURE_SERIALIZATION=1 for %s", why
        )
    elif value.strip() in ("", "0"):
        raise ValueError(
            f"engine_process=separate sends the engine core {why}, which vLLM pickles only with "
            f"VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set to {value!r} here): unset it, or use "
            "engine_process=same"
        )


def log_choices(choices: VllmChoices, on_cpu: bool, *given: bool | str) -> None:
    """One line per engine start with what each speed option came to, and whether it was asked for or "auto":
    the first thing to read when a GPU run is slower than expected."""
    values = (
        choices.enforce_eager,
        choices.seeded_sampling,
        "separate" if choices.separate_process else "same",
    )
    names = ("enforce_eager", "seeded_sampling", "engine_process")
    log.info(
        "vLLM engine on %s: %s",
        "CPU" if on_cpu else "GPU",
        ", ".join(
            f"{n}={v}" + (" (auto)" if g == "auto" else "") for n, v, g in zip(names, values, given)
        ),
    )


def bind_cpu_workers(tp: int) -> None:
    """Give each of vLLM's CPU worker processes its share of this process's cores, where vLLM cannot itself.

    vLLM's CPU default (``VLLM_CPU_OMP_THREADS_BIND=auto``) binds each TP worker to a NUMA node of its own and
    refuses to start with fewer NUMA nodes than workers, which is the usual case below a large CPU server. Then
    the cores this process may use (its Slurm / MPI binding) are split evenly among the workers, in order. A
    binding set by the user, or enough NUMA nodes for ``auto``, is left alone; with fewer cores than workers
    nothing is bound ("nobind")."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    numa_nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    if numa_nodes >= tp:
        return
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
        "|".join(",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(tp))
        if share
        else "nobind"
    )


def freeze_imported_heap() -> None:
    """Collect once, then freeze what is left (the modules torch and vLLM just imported, millions of objects).

    vLLM's engine start walks the whole heap five times (a full collection before and after its model
    loader processes the weights, then ``vllm.utils.gc_utils.freeze_gc_heap``'s three passes, after which it
    freezes the heap itself): ~0.2 s each on CPU. Frozen first, the imported heap is left out of those walks
    (about 1 s less per start). Collecting before freezing keeps the end state vLLM's own freeze gives:
    garbage is freed, not frozen.
    """
    gc.collect()
    gc.freeze()


class _DropChatTemplateWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"


def quiet_chat_template_warmup() -> None:
    """Drop vLLM's "Chat template warmup failed" warning and its traceback from every engine start's log.

    ``LLM`` renders a chat message at start-up to warm its template, which needs the tokenizer; this engine
    starts vLLM without one (``skip_tokenizer_init``: prompts arrive as token ids, chat templates are applied by
    rollhpc's own tokenizer), so the warm-up always fails, and its traceback read as an error in every
    generate rank's log. Only that record is dropped; vLLM's other warnings stay."""
    logger = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _DropChatTemplateWarmup) for f in logger.filters):
        logger.addFilter(_DropChatTemplateWarmup())


def eager_token_ranks_on_cpu() -> None:
    """Use the plain function for vLLM's ``batched_count_greater_than`` (the rank of each sampled token).

    vLLM wraps it in ``torch.compile`` (inductor) to spare GPU memory at large batches; on CPU that is a
    C++ build at the engine's first step: 2 s with a warm inductor cache and 13 s with a cold one (a new
    node), paid at every start before the first rollout, for an op that takes microseconds at CPU batch
    sizes (the eager form's temporary is a [requests, vocab] boolean). It returns the same integer counts.
    No other compiled op runs in a dense model's CPU step (measured: one compilation per engine). The
    sampler module's name is rebound, so every engine of this process uses it; left alone if vLLM's sampler
    no longer has it.
    """
    compiled = getattr(sampler, "batched_count_greater_than", None)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is not None:
        sampler.batched_count_greater_than = eager
