"""What megatron-core's data-parallel step costs on CPU with gloo, as megatron calls it and as rollhpc's CPU shim
(rollhpc/models/megatron_cpu.py) runs it instead: extra resident memory and seconds, two ranks on one machine.

Without overlapped communication (CUDA only) megatron's DDP puts the whole model in one gradient bucket, so each
of these runs once per optimizer step over every parameter of the rank's stage:
- the gradient reduce-scatter: gloo's ``reduce_scatter_tensor`` inside megatron's ``_coalescing_manager`` (as
  ``param_and_grad_buffer`` issues it) against the shim's in-place all-reduce of the bucket;
- the parameter all-gather after the distributed optimizer's step: gloo's ``all_gather_into_tensor`` against the
  shim's in-place sum with the other ranks' shards zeroed (bf16, exact);
- the Adam step on one rank's shard: torch's AdamW as megatron builds it without Transformer Engine or apex
  (the per-parameter loop) against its fused CPU kernel, on one parameter the size of Qwen2.5-0.5B's embedding
  shard at DP=2 (68M fp32 elements).
Each result is checked equal between the two forms (reduce-scatter: the rank's shard; all-gather: bit for bit;
Adam: within float32 rounding). Extra memory: the largest VmRSS sampled every 2 ms during the call minus VmRSS
before it. Medians over --repeats.

    python bench/cpu_collectives.py                # 1 GiB fp32 gradient bucket per rank, ~6 GiB at once, ~2 min
    python bench/cpu_collectives.py --mib 64       # smoke test

Results: bench/results/cpu_collectives.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The largest VmRSS seen by a 2 ms sampler thread since the last ``reset``."""

    def __init__(self) -> None:
        self.value = _rss()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.value = max(self.value, _rss())
            time.sleep(0.002)

    def reset(self) -> int:
        self.value = now = _rss()
        return now


def _measure(peak: _Peak, fn, barrier) -> tuple[float, int]:  # noqa: ANN001
    barrier()
    time.sleep(0.05)
    before = peak.reset()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    time.sleep(0.02)
    return seconds, peak.value - before


def _rank(
    rank: int, world: int, port: int, elements: int, adam_elements: int, repeats: int, out: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from rollhpc.models.megatron_cpu import (
        _all_gather_by_all_reduce,
        _FusedAdamW,
        _reduce_scatter_by_all_reduce,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    group = dist.new_group(list(range(world)))
    peak = _Peak()
    shard = elements // world
    rows: dict[str, dict[str, list[float]]] = {}

    def record(name: str, fn) -> None:  # noqa: ANN001
        s, extra = _measure(peak, fn, dist.barrier)
        rows.setdefault(name, {"seconds": [], "extra_bytes": []})
        rows[name]["seconds"].append(s)
        rows[name]["extra_bytes"].append(extra)

    def as_megatron_issues(name: str, base: "torch.Tensor", call) -> "torch.Tensor":  # noqa: ANN001
        """A copy of ``base`` (the bucket), ``call(bucket, this rank's shard of it)`` run on it inside megatron's
        ``_coalescing_manager`` and measured as ``name``; the bucket after."""
        bucket = base.clone()
        mine = bucket[rank * shard : (rank + 1) * shard]

        def issue() -> None:
            with _coalescing_manager(group, async_ops=False):
                call(bucket, mine)

        record(name, issue)
        return bucket

    gen = torch.Generator().manual_seed(rank)
    grads = torch.randn(elements, generator=gen)
    checks = {}
    for _ in range(repeats):
        own = slice(rank * shard, (rank + 1) * shard)
        expected = as_megatron_issues(
            "reduce_scatter/gloo",
            grads,
            lambda bucket, mine: dist.reduce_scatter_tensor(mine, bucket, group=group),
        )[own].clone()
        reduced = as_megatron_issues(
            "reduce_scatter/all_reduce",
            grads,
            lambda bucket, mine: _reduce_scatter_by_all_reduce(
                mine, bucket, op=dist.ReduceOp.SUM, group=group
            ),
        )[own]
        checks["reduce_scatter_max_abs_diff"] = float((reduced - expected).abs().max())
        del expected, reduced

        params = torch.randn(elements, generator=gen).to(torch.bfloat16)
        expected = as_megatron_issues(
            "all_gather/gloo",
            params,
            lambda bucket, mine: dist.all_gather_into_tensor(bucket, mine, group=group),
        )
        summed = as_megatron_issues(
            "all_gather/all_reduce",
            params,
            lambda bucket, mine: _all_gather_by_all_reduce(bucket, mine, group=group),
        )
        checks["all_gather_bitwise_equal"] = bool(
            torch.equal(summed.view(torch.int16), expected.view(torch.int16))
        )
        del params, summed, expected

        results = {}
        for name, cls in (("adam/per_parameter", torch.optim.AdamW), ("adam/fused", _FusedAdamW)):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(adam_elements))
            p.grad = torch.randn(adam_elements)
            opt = cls([p], lr=1e-3, weight_decay=0.01)
            opt.step()  # the moments exist from the first step on
            record(name, opt.step)
            results[name] = p.detach().clone()
            del opt, p
        checks["adam_max_abs_diff"] = float(
            (results["adam/per_parameter"] - results["adam/fused"]).abs().max()
        )
        del results
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "checks": checks}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--mib",
        type=int,
        default=1024,
        help="the fp32 gradient bucket per rank (MiB); the bf16 "
        "parameter bucket has as many elements",
    )
    ap.add_argument(
        "--adam-elements",
        type=int,
        default=68_075_008,
        help="the Adam parameter (default: Qwen2.5-0.5B's 151936 x 896 embedding, half of it)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_collectives.json"))
    args = ap.parse_args()
    import multiprocessing as mp
    import socket

    import torch

    from provenance import commit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    elements = args.mib * (1 << 20) // 4
    elements -= elements % 2
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_rank, args=(r, 2, port, elements, args.adam_elements, args.repeats, out)
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        measured = json.loads(Path(out).read_text())
    table = {}
    for name, r in measured["rows"].items():
        table[name] = {
            "seconds_median": statistics.median(r["seconds"]),
            "seconds": r["seconds"],
            "extra_mib_median": statistics.median(r["extra_bytes"]) / (1 << 20),
            "extra_mib": [b / (1 << 20) for b in r["extra_bytes"]],
        }
    result = {
        "bench": "cpu_collectives",
        "commit": commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "threads_per_rank": 1,
        },
        "ranks": 2,
        "gradient_bucket_mib": args.mib,
        "parameter_bucket_mib": args.mib // 2,
        "adam_elements": args.adam_elements,
        "repeats": args.repeats,
        "rows": table,
        "checks": measured["checks"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp_out = Path(args.out).with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp_out, args.out)
    print(f"{'':28s} {'seconds':>9s} {'extra MiB':>10s}")
    for name, r in table.items():
        print(f"{name:28s} {r['seconds_median']:9.2f} {r['extra_mib_median']:10.0f}")
    print("checks:", measured["checks"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
