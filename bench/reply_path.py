"""Rank 0's own work to take the replies of one call to N ranks, directly or as bundles of a reply tree, and a
relay's work per bundle it collects, at N up to the 8,769 ranks of `moe_4096_selfcheck` (issue 36).

    python bench/reply_path.py [--ranks 64,128,256,1024,8769] [--fan-in 16] [--per-host 8]
                               [--out bench/results/reply_path.json]

Why apart from bench/scale.py: there every rank shares this machine's 2 cores, so rank 0's CPU per call is mostly
polling while the others take turns, and the wall time measures the turns. Here one process plays both ends: the
messages a call's replies would be are sent to itself first (MPI, real headers, real payloads), then rank 0's
real receive path (`Controller.wait`: probe, receive, unpickle, decode, bookkeeping) takes them, timed in this
thread's CPU seconds. Direct: N reply messages. Tree: the bundles that `build_reply_tree` sends to rank 0 (node
leaders over --per-host ranks per node, groups of --fan-in), each with its subtree's replies. Relay: receiving
fan_in - 1 bundles of fan_in replies each, merging them with its own and sending the merged bundle on.
Not measured here: the network's latency per hop (a tree adds its depth in hops; MPI's published small-message
latency on InfiniBand is 1-2 us) and the workers' own time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.provenance import commit, write_figure, write_result  # noqa: E402
from bench.scale import GATHER_BYTES, SMALL, TARGET_RANKS, fit  # noqa: E402

TAG_SELF_RELAY = 77


class _NoDeaths:
    """The sideband's one question the receive path asks (no worker dies in this benchmark)."""

    def dead_ranks(self) -> list[int]:
        return []


def _controller(n: int, run_dir: Path):  # noqa: ANN202
    from mpi4py import MPI

    from rollhpc.controller.runtime import Controller, RankInfo
    from rollhpc.transport.mpi_channel import MpiChannel

    ranks = {r: RankInfo(r, "probe", r - 1, f"node{(r - 1) // 8}", 0) for r in range(0, n + 1)}
    return Controller(MpiChannel(MPI.COMM_WORLD), _NoDeaths(), ranks, run_dir, 600.0, 1.0)


def _reply_env(call_id: int) -> dict:
    return {"kind": "result", "call_id": call_id, "call_s": 0.001, "cpu_s": 1.0}


def _bundle(ranks: list[int], payload):  # noqa: ANN001, ANN202 - a Bundle
    from rollhpc.transport.reply_tree import Bundle

    return Bundle.merge([Bundle.of_reply(r, _reply_env(0), payload) for r in ranks])


def direct(ctl, n: int, payload) -> float:  # noqa: ANN001
    """CPU seconds to take N reply messages (keys (0, id): the same work per message as N ranks' replies)."""
    from rollhpc.transport.mpi_channel import TAG_REPLY, Encoded

    enc = Encoded.of(payload)
    base = next(ctl._ids) * 100_000
    for i in range(n):
        ctl.channel.send_encoded(0, TAG_REPLY, _reply_env(base + i), enc)
    keys = [(0, base + i) for i in range(n)]
    t = time.thread_time()
    ctl.wait(keys, "direct")
    return time.thread_time() - t


def bundled(ctl, n: int, payload, fan_in: int, per_host: int) -> tuple[float, int]:  # noqa: ANN001
    """CPU seconds to take one call's replies from N ranks as the tree's top bundles; the bundles' count."""
    from rollhpc.transport.mpi_channel import TAG_REPLY
    from rollhpc.transport.reply_tree import CONTROLLER, build_reply_tree

    ranks = list(range(1, n + 1))
    tree = build_reply_tree(ranks, {r: f"node{(r - 1) // per_host}" for r in ranks}, fan_in)
    call_id = next(ctl._ids)

    def subtree(r: int) -> list[int]:
        out = [r]
        for c in tree.children.get(r, ()):
            out += subtree(c)
        return out

    tops = [r for r in ranks if tree.parent[r] == CONTROLLER]
    for top in tops:
        ctl.channel.send(0, TAG_REPLY, *_bundle(subtree(top), payload).encode(call_id))
    keys = [(r, call_id) for r in ranks]
    t = time.thread_time()
    ctl.wait(keys, "bundled")
    return time.thread_time() - t, len(tops)


def relay(channel, payload, fan_in: int) -> float:  # noqa: ANN001
    """CPU seconds of a relay's part: take fan_in - 1 bundles of fan_in replies each, merge them with its own
    reply and send the merged bundle on (here to itself, taken back after the clock stops)."""
    from rollhpc.transport.reply_tree import Bundle

    child = _bundle(list(range(fan_in)), payload).encode(1)
    for _ in range(fan_in - 1):
        channel.send(0, TAG_SELF_RELAY, *child)
    t = time.thread_time()
    got = []
    while len(got) < fan_in - 1:
        if (msg := channel.poll(TAG_SELF_RELAY)) is not None:
            got.append(Bundle.decode(msg.envelope, msg.payload))
    merged = Bundle.merge([_bundle([0], payload), *got])
    channel.send(0, TAG_SELF_RELAY + 1, *merged.encode(1))
    spent = time.thread_time() - t
    while channel.poll(TAG_SELF_RELAY + 1) is None:
        pass
    channel.flush(10)
    return spent


def plot(results: dict, sizes: list[int], path: Path) -> None:
    """Rank 0's work per call against the ranks, direct and as bundles, each with its fit, one panel per payload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.6), squeeze=False)
    grid = np.geomspace(min(sizes), TARGET_RANKS, 50)
    for ax, (name, r) in zip(axes.flat, results.items()):
        for key, label in (("direct_s", "direct"), ("tree_s", "as bundles")):
            ys = [r["by_ranks"][str(n)][key] * 1e3 for n in sizes]
            (line,) = ax.plot(sizes, ys, "o", label=f"{label}, measured")
            if f := r["fits"].get(key):
                model = f["a"] + f["b"] * (grid if f["model"] == "linear" else np.log2(grid))
                ax.plot(
                    grid,
                    model * 1e3,
                    "-",
                    color=line.get_color(),
                    label=f"{f['model']} fit -> {f['at_target'] * 1e3:.3g} ms at {TARGET_RANKS}",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"rank 0's work for one call's replies ({name})", fontsize=9)
        ax.set_xlabel("ranks")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    write_figure(path, fig)


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default=f"64,128,256,1024,{TARGET_RANKS}")
    ap.add_argument("--fan-in", type=int, default=16)
    ap.add_argument(
        "--per-host", type=int, default=8, help="ranks per node (the node leaders' groups)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="medians over this many calls")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "reply_path.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    payloads = {"small": SMALL, "64KiB": np.zeros(GATHER_BYTES, dtype=np.uint8)}
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        ctl = _controller(max(sizes), Path(tmp))
        for name, payload in payloads.items():
            rows = {}
            for n in sizes:
                d = statistics.median(direct(ctl, n, payload) for _ in range(args.repeats))
                tree = [
                    bundled(ctl, n, payload, args.fan_in, args.per_host)
                    for _ in range(args.repeats)
                ]
                b = statistics.median(t for t, _ in tree)
                rows[str(n)] = {
                    "direct_s": d,
                    "tree_s": b,
                    "tree_messages": tree[0][1],
                    "direct_us_per_rank": d / n * 1e6,
                    "tree_us_per_rank": b / n * 1e6,
                }
                print(
                    f"{name} N={n}: rank 0 takes the replies directly in {d * 1e3:.2f} ms, as {tree[0][1]} bundles "
                    f"in {b * 1e3:.2f} ms",
                    flush=True,
                )
            r = statistics.median(
                relay(ctl.channel, payload, args.fan_in) for _ in range(args.repeats)
            )
            results[name] = {
                "by_ranks": rows,
                "relay_s": r,
                "fits": {
                    k: fit(sizes, [rows[str(n)][k] for n in sizes]) for k in ("direct_s", "tree_s")
                }
                if len(sizes) >= 2
                else {},
            }
            print(
                f"{name}: a relay's part ({args.fan_in - 1} bundles of {args.fan_in} in, one out) {r * 1e3:.2f} ms",
                flush=True,
            )
    out = {
        "bench": "reply_path",
        "commit": commit(),
        "fan_in": args.fan_in,
        "ranks_per_node": args.per_host,
        "sizes": sizes,
        "results": results,
        "what": "rank 0's CPU seconds (this thread) to take one call's replies: direct = N messages, tree = the "
        "reply tree's top bundles; relay = one relay's CPU to collect fan_in - 1 bundles and send one",
        "assumptions": "one process sends the messages to itself through MPI (MPICH's self path: no network, no "
        "other process); a tree's extra latency is its depth in network hops plus each level's "
        "relay part, not measured here",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_result(args.out, out)
    plot(results, sizes, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
