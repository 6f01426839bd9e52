"""What a rank can say about where it runs, and how fast it talks to others: the cluster check's probes.

Here, beside the Worker base class, so that every role (Megatron, vLLM, the torch engine, a reward or env rank)
answers them through ``Worker.placement_probe`` / ``Worker.collective_bandwidth`` with no code of its own
(``rollhpc.pipelines.cluster_check`` reads them). Nothing here changes the rank: the bandwidth probe uses a
process group of its own (a standalone ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` over a ``PrefixStore``, as
the weight sync does), never the role's default group, and drops it before it returns.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rollhpc.rundir.records import this_host

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

# what a rank reports of its Slurm step, so a wrong placement can be read off the table's JSON
_SLURM_KEYS = (
    "SLURM_PROCID",
    "SLURM_NODEID",
    "SLURM_STEP_NODELIST",
    "SLURM_CPUS_PER_TASK",
    "SLURM_CPU_BIND",
    "SLURM_HET_SIZE",
)


def _rss_bytes() -> float:
    """This process's resident memory (what a CPU rank holds after start-up), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def _gpu_memory(torch: ModuleType) -> list[dict[str, float]]:
    """Device-wide use of each visible GPU (every process on it counted: colocated roles share it), read through
    NVML where torch has it, so the probe itself does not create a CUDA context on a GPU the rank never used."""
    out = []
    for i in range(torch.cuda.device_count()):
        total = float(torch.cuda.get_device_properties(i).total_memory)
        try:
            used = float(torch.cuda.device_memory_used(i))
        except Exception:  # noqa: BLE001 - no NVML: the runtime's view (creates a context on that device)
            free, total_ = torch.cuda.mem_get_info(i)
            used, total = float(total_ - free), float(total_)
        out.append({"index": i, "used": used, "total": total})
    return out


def placement(gpus: bool = True) -> dict[str, Any]:
    """Where this process runs: host (Slurm's node name), the GPUs it sees (CUDA_VISIBLE_DEVICES and what CUDA
    counts), its CPU core set, and its memory right now (GPU per device, host RSS). ``gpus`` false (a CPU role):
    CUDA is not touched, so the probe does not put a CUDA context of its own on a GPU the rank does not use."""
    torch: ModuleType | None = None
    if gpus:  # torch on a login node's import path only when it runs (spec.WorkerSpec imports this module)
        import torch
    cuda = torch is not None and torch.cuda.is_available()
    gpu_id = None
    if cuda:
        try:
            gpu_id = str(torch.cuda.get_device_properties(0).uuid)
        except Exception:  # noqa: BLE001 - older torch: the visible-devices string identifies it on its host
            gpu_id = None
    return {
        "host": this_host(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda": cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "gpu_id": gpu_id or f"{this_host()}:{os.environ.get('CUDA_VISIBLE_DEVICES', '')}",
        "cpus": sorted(os.sched_getaffinity(0)),
        "host_cpus": os.cpu_count() or 0,
        "gpu_memory": _gpu_memory(torch) if cuda else [],
        "rss": _rss_bytes(),
        "slurm": {k: os.environ[k] for k in _SLURM_KEYS if k in os.environ},
    }


@dataclass(frozen=True)
class CollectiveProbe:
    """One rank's part in a bandwidth measurement the controller chose (the cluster check): ``op`` (all_reduce,
    or broadcast from rank 0) among ``world`` ranks, this one ``rank`` of them, in a process group of their own
    that meets at the controller's store ``address`` under ``tag``; each of ``sizes`` (bytes) timed over
    ``iters`` calls after one warm-up."""

    address: tuple[str, int]
    tag: str
    rank: int
    world: int
    op: str
    sizes: list[int]
    iters: int
    timeout_s: float = 120.0


def _group(probe: CollectiveProbe) -> tuple[dist.ProcessGroup, torch.device]:
    """A process group of ``probe.world`` ranks for this one measurement (NCCL where CUDA is, else gloo),
    meeting at the controller's store under ``probe.tag``; and the device its tensors live on."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=probe.timeout_s)
    host, port = probe.address
    store = dist.PrefixStore(
        f"rollhpc-probe-{probe.tag}", dist.TCPStore(host, port, None, False, timeout=timeout)
    )
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        opts = dist.ProcessGroupNCCL.Options()
        return dist.ProcessGroupNCCL(store, probe.rank, probe.world, opts), device
    return dist.ProcessGroupGloo(store, probe.rank, probe.world, timeout), torch.device("cpu")


def _run_op(group: dist.ProcessGroup, op: str, t: torch.Tensor) -> None:
    """One collective on the probe's own group (its ops, not torch.distributed's functions on the default group)."""
    import torch.distributed as dist

    if op == "all_reduce":
        group.allreduce([t]).wait()
    else:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        group.broadcast([t], opts).wait()


def collective_bandwidth(probe: CollectiveProbe) -> dict[str, Any]:
    """Seconds per ``probe.op`` (all_reduce, or broadcast from rank 0) of each size in bytes, averaged over
    ``probe.iters`` after one warm-up (NCCL builds its communicator at the first call). The caller takes the
    slowest rank's time, as a collective ends for everyone when the last rank is done."""
    import torch

    op = probe.op
    if op not in ("all_reduce", "broadcast"):
        raise ValueError(f"op: all_reduce or broadcast, not {op!r}")
    group, device = _group(probe)
    times = []
    try:
        for size in probe.sizes:
            t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            _run_op(group, op, t)  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(probe.iters):
                _run_op(group, op, t)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) / probe.iters)
            del t
    finally:
        shutdown = getattr(group, "shutdown", None)
        if device.type == "cuda" and shutdown is not None:
            shutdown()  # NCCL's communicator and its buffers go now, not at the next garbage collection
        del group
    return {
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "device": str(device),
        "seconds": times,
    }
