"""The yardsticks for the GPU check's offload and weight-sync numbers: this device's own copy bandwidth
(device to device), and pinned host <-> device copies, each the median of 5 timed copies of 1 GiB.

    python tools/gpu_bandwidth.py [--gib 1] [--out FILE]

Offload moves parameters and optimizer states between the GPU and pinned host buffers, so its GB/s is
judged against the pinned copies here; a CUDA-IPC weight sync copies device to device, so against the
device copy (issue 32's target: at least half of it). JSON to --out and to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def timed_copy(dst, src, repeats: int = 5) -> float:  # noqa: ANN001 - torch tensors
    """Median seconds of ``dst.copy_(src)`` (CUDA events; one warm-up copy first)."""
    import torch

    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bandwidth: no CUDA device", file=sys.stderr)
        return 2
    n = int(args.gib * (1 << 30))
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gb = n / 1e9
    result = {
        "device": torch.cuda.get_device_name(0),
        "bytes": n,
        "device_copy_gb_s": round(gb / timed_copy(b, a), 1),  # reads and writes n bytes each
        "device_to_pinned_host_gb_s": round(gb / timed_copy(host, a), 1),
        "pinned_host_to_device_gb_s": round(gb / timed_copy(a, host), 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
