"""Bucketed weight sync: packing round trip and the broadcast channel between real processes (gloo)."""

from __future__ import annotations


import pytest
import torch
import torch.multiprocessing as mp

from rollhpc.weight_sync.broadcast import WeightBroadcast, open_store
from rollhpc.weight_sync.buckets import pack_buckets, unpack_bucket


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 4, generator=g),
        "b": torch.randn(100, generator=g).to(torch.bfloat16),
        "c": torch.randn(7, 5, generator=g),
        "d": torch.arange(6, dtype=torch.float32).view(2, 3),
    }


def test_buckets_round_trip_bitwise_and_respect_the_size():
    w = _weights()
    # smaller than most tensors: one bucket each
    buckets = list(pack_buckets(w.items(), bucket_bytes=64))
    assert all(len({b.data.dtype}) == 1 for b in buckets)
    assert sum(len(b.names) for b in buckets) == len(w)
    back = {n: t for b in buckets for n, t in unpack_bucket(b)}
    assert back.keys() == w.keys() and all(
        torch.equal(back[k], w[k]) and back[k].dtype == w[k].dtype for k in w
    )
    (one,) = [
        b for b in pack_buckets(w.items(), bucket_bytes=1 << 20) if b.data.dtype == torch.float32
    ]
    assert one.names == ["a", "c", "d"] and one.nbytes == (12 + 35 + 6) * 4


def _receiver(rank: int, port: int, out: dict) -> None:
    from rollhpc.weight_sync.buckets import WeightSyncMismatch

    ch = WeightBroadcast(rank, 3, "127.0.0.1", port)
    for round_ in range(3):
        try:
            out[(rank, round_)] = {n: t.clone() for n, t in ch.receive()}
        except WeightSyncMismatch as e:
            out[(rank, round_)] = str(e)
            # the rest of the stream, as a worker ends its call before the run stops
            for _ in ch.receive():
                pass


def test_broadcast_reaches_every_generator_bitwise_and_names_a_bad_bucket(monkeypatch):
    """Two receivers in processes of their own (gloo): a verified sync, an unverified one, then a verified one
    whose first bucket the sender corrupts after stamping it (a bit flipped, as a stream race would): each
    receiver stops at the parameter concerned, before handing anything of that bucket on."""
    from rollhpc.testing.fault_injection import CORRUPT_WEIGHT_SYNC

    monkeypatch.setenv(CORRUPT_WEIGHT_SYNC, "3")
    store = open_store(timeout_s=60)
    out = mp.Manager().dict()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver, args=(r, store.port, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    sender = WeightBroadcast(0, 3, "", 0, store=store)
    w = _weights()
    sent = sender.send(w.items(), bucket_bytes=256, verify=True)
    w2 = {k: v * 2 for k, v in w.items()}
    sender.send(w2.items(), bucket_bytes=1 << 20)
    sender.send(w.items(), bucket_bytes=256, verify=True)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    # + the alignment of each tensor
    assert sent >= sum(t.numel() * t.element_size() for t in w.values())
    for rank in (1, 2):
        for round_, ref in enumerate((w, w2)):
            got = out[(rank, round_)]
            assert got.keys() == ref.keys()
            assert all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)
        assert out[(rank, 2)].startswith(
            "weight sync 3: parameter a (3, 4) torch.float32 arrived with other bytes "
            "than the trainer sent (checksum 0x"
        ), out[(rank, 2)]


def test_the_checksum_is_exact_order_sensitive_and_the_same_on_any_layout():
    from rollhpc.weight_sync.buckets import tensor_checksum

    t = torch.randn(1001, generator=torch.Generator().manual_seed(1))
    assert (
        tensor_checksum(t)
        == tensor_checksum(t.clone())
        == tensor_checksum(t.view(7, 143).t().contiguous().t())
    )
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert tensor_checksum(swapped) != tensor_checksum(t)
    nudged = t.clone()
    nudged.view(torch.int32)[500] += 1  # one ulp
    assert tensor_checksum(nudged) != tensor_checksum(t)
    odd = torch.arange(7, dtype=torch.uint8)  # 7 bytes: byte words
    assert tensor_checksum(odd) != tensor_checksum(torch.arange(7, dtype=torch.uint8).flip(0))
    assert tensor_checksum(t.to(torch.bfloat16)) != tensor_checksum(t)


def _plan(*ranks: tuple[str, int, int, int, tuple[int, ...]]):
    from rollhpc.placement.device_mapping import RankPlacement, WorldPlan

    return WorldPlan(
        [
            RankPlacement(i, role, g, comp, node, gpus)
            for i, (role, g, comp, node, gpus) in enumerate([("controller", 0, 0, 0, ()), *ranks])
        ],
        [],
    )


def assert_valid_routing(plan, routing) -> None:
    """Every generator rank has exactly one route, from the trainer's rank 0; an IPC route is on that rank's GPU;
    the broadcast group (the trainer's rank 0 and the generators it serves) never holds two ranks of one GPU."""
    from rollhpc.weight_sync.routing import BROADCAST, IPC

    source = next(p for p in plan.ranks if p.role == "train" and p.group_rank == 0)
    home = (source.component, source.node, source.gpus[0]) if source.gpus else None
    gens = sorted(p.group_rank for p in plan.ranks if p.role == "generate")
    assert sorted(r.generator for r in routing.routes) == gens
    assert all(r.source == 0 for r in routing.routes)
    # by CUDA IPC on that rank's GPU, or on CPU by shared memory on its host
    assert all(r.place == home for r in routing.routes if r.transport == IPC)
    members = [home] + [r.place for r in routing.routes if r.transport == BROADCAST]
    on_gpus = [m for m in members if m is not None]
    assert len(on_gpus) == len(set(on_gpus)), members


def test_each_generator_gets_ipc_on_the_trainers_gpu_else_the_broadcast():
    """``auto`` routes per generator rank: CUDA IPC where it shares the GPU of the trainer's rank 0 (same het
    group, node, GPU), the broadcast group everywhere else; a layout that would put two ranks of one GPU into
    the broadcast group (NCCL refuses it) is refused, as is ``ipc`` forced on a generator elsewhere."""
    from rollhpc.weight_sync.routing import RoutingError, route_weights

    one_gpu = _plan(("train", 0, 1, 0, (0,)), ("generate", 0, 1, 0, (0,)))
    assert route_weights(one_gpu).mode == "ipc"
    with pytest.raises(RoutingError, match="set pipeline.options.weight_sync=auto"):
        route_weights(one_gpu, "broadcast")  # two ranks of GPU 0 in one NCCL group
    # colocated, but generator 1 is on another GPU than trainer 0
    spread = _plan(
        ("train", 0, 1, 0, (0,)),
        ("train", 1, 1, 0, (1,)),
        ("generate", 0, 1, 0, (0,)),
        ("generate", 1, 1, 0, (1,)),
    )
    routing = route_weights(spread)
    assert (
        routing.mode == "mixed"
        and routing.ranks("ipc") == [0]
        and routing.ranks("broadcast") == [1]
    )
    assert_valid_routing(spread, routing)
    with pytest.raises(
        RoutingError,
        match="trainer's rank 0 and generate rank 0 would both be in the broadcast "
        "group on GPU 0 of node 0 in het group 1, and NCCL refuses",
    ):
        # the old choice for this layout: a failure at the first sync
        route_weights(spread, "broadcast")
    with pytest.raises(
        RoutingError,
        match="weight_sync=ipc needs every generator on the GPU of the trainer's rank 0",
    ):
        route_weights(spread, "ipc")
    # GPU 0 of another het group's node
    apart = _plan(("train", 0, 1, 0, (0,)), ("generate", 0, 2, 0, (0,)))
    assert route_weights(apart).mode == "broadcast"
    cpu = _plan(("train", 0, 0, 0, ()), ("generate", 0, 0, 0, ()), ("generate", 1, 0, 0, ()))
    assert route_weights(cpu).mode == "broadcast"  # gloo: no GPU to share
    # forced: shared-memory slots on the trainer's host
    assert route_weights(cpu, "ipc").mode == "ipc"
    assert_valid_routing(cpu, route_weights(cpu, "ipc"))
    with pytest.raises(
        RoutingError, match="or on CPU on its host; generate rank 1 receives on CPU"
    ):
        route_weights(
            _plan(("train", 0, 0, 0, ()), ("generate", 0, 0, 0, ()), ("generate", 1, 0, 1, ())),
            "ipc",
        )
    two_on_one = _plan(
        ("train", 0, 1, 0, (0,)), ("generate", 0, 2, 0, (3,)), ("generate", 1, 2, 0, (3,))
    )
    with pytest.raises(
        RoutingError, match="generate rank 0 and generate rank 1 would both be in the broadcast"
    ):
        route_weights(two_on_one)
    # relay forms no group: nothing to refuse
    assert route_weights(two_on_one, "relay").mode == "broadcast"


@pytest.mark.parametrize(
    "name, overrides, ipc",
    [
        ("qwen2.5-7b_grpo", [], [0]),
        ("qwen3-30b-a3b_grpo", [], None),
        ("qwen2.5-0.5b_gsm8k", [], None),
        (
            "moe_4096_selfcheck",
            [],
            [0],
        ),  # generator 0 on node 0's 8 GPUs, 511 others in a group of 512
        # partial overlap: the trainer on half of the generators' GPUs, its rank 0 on GPU 2 (generator 1's first GPU)
        (
            "qwen2.5-7b_grpo",
            [
                "roles.train.procs=8",
                "roles.train.devices=[2,3,0,1,4,5,6,7]",
                "roles.reference.procs=8",
                "roles.reference.devices=[0,1,2,3,4,5,6,7]",
                "pipeline.options.rollout.max_staleness=1",
            ],
            [1],
        ),
    ],
    ids=["7b", "30b", "0.5b", "moe4096", "partial-overlap"],
)
def test_shipped_layouts_route_each_generator_once_one_rank_per_gpu(name, overrides, ipc):
    from rollhpc.cli.experiment import load_experiment
    from rollhpc.placement.device_mapping import plan_world, weight_sync_routing

    from rollhpc.weight_sync.routing import route_weights

    cfg = load_experiment(name, overrides)
    plan = plan_world(cfg)
    # the 4096-GPU self-check's pipeline syncs no weights; its layout is routed as an RLVR run would route it
    routing = weight_sync_routing(cfg, plan) or route_weights(plan)
    assert_valid_routing(plan, routing)
    if ipc is not None:
        assert routing.ranks("ipc") == ipc


def test_plan_prints_each_generators_source_transport_and_bytes(tmp_path):
    """`rollhpc plan qwen2.5-7b_grpo`: generator 0 shares GPU 0 with the trainer's rank 0 (CUDA IPC), the other
    seven receive in one NCCL broadcast group of 8; the size is shown once the model's config.json is readable."""
    from tests.support.processes import rollhpc

    res = rollhpc("plan", "qwen2.5-7b_grpo", "--no-ranks", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split("weight sync (auto: mixed), per generator rank:\n")[1].splitlines()
    assert lines[0].split() == [
        "generate",
        "0",
        "<-",
        "train",
        "rank",
        "0:",
        "CUDA",
        "IPC",
        "(same",
        "GPU,",
        "device",
        "to",
        "device);",
        "receives",
        "on",
        "het",
        "group",
        "1",
        "node",
        "0",
        "GPU",
        "0;",
        "size",
        "unknown",
        "(no",
        "config.json",
        "here)",
    ]
    assert (
        "generate   7 <- train rank 0: broadcast (NCCL, group of 8); receives on het group 1 node 1 GPU 6;"
        in res.stdout
    )


# ------------------------------------------------------------------ streamed sync through reused slots (shm, MPI)
SLOT_MB = 4


def _slot_model(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """~52 MiB in two dtypes (13x the slot), one tensor (8 MiB) larger than a slot, a scalar and odd sizes."""
    g = torch.Generator().manual_seed(7)
    w: dict[str, torch.Tensor] = {
        "scalar": torch.tensor(3.5) * scale,
        "bias": torch.randn(1001, generator=g) * scale,
    }
    for i in range(20):
        w[f"layer{i}.weight"] = torch.randn(512, 1024, generator=g) * scale
        if i % 3 == 0:
            w[f"layer{i}.norm"] = (torch.randn(256, 1024, generator=g) * scale).to(torch.bfloat16)
        if i == 9:
            w["big.weight"] = (torch.randn(4 << 20, generator=g) * scale).to(torch.bfloat16)
    return w


def _digests(named) -> dict[str, str]:
    import hashlib

    return {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        + str(t.dtype)
        + str(tuple(t.shape))
        for n, t in named
    }


def _failing(named, after: int):
    for i, item in enumerate(named):
        if i == after:
            raise RuntimeError("export failed (test)")
        yield item


def _slot_world(out_path: str) -> None:
    """Run by mpiexec: world rank 0 sends six syncs through shared-memory slots, ranks 1.. receive each."""
    import json
    import os

    from mpi4py import MPI

    from rollhpc.weight_sync.broadcast import open_store
    from rollhpc.weight_sync.shared_memory import ShmSlots
    from rollhpc.weight_sync.slots import SlotReceiver, SlotSender, StoreControl, connect_store

    comm = MPI.COMM_WORLD
    rank, receivers = comm.Get_rank(), comm.Get_size() - 1
    store = open_store(timeout_s=60) if rank == 0 else None
    port = comm.bcast(store.port if rank == 0 else None)
    store = store or connect_store("127.0.0.1", port, timeout_s=60)
    w = _slot_model()
    # the first sync of a fresh process also pays its one-time costs (torch's thread pools and their allocator
    # arenas: ~25-30 MiB of resident memory at the first large reductions and copies), which are no sync's
    plan = [
        ("warm-up", w, True, None),
        ("plain", w, True, None),
        ("doubled", _slot_model(2.0), False, None),
        ("corrupt", w, True, None),
        ("receiver fails", w, False, None),
        ("sender fails", w, False, 5),
    ]
    result: dict = {}
    for sync, (name, model, verify, fail_after) in enumerate(plan, start=1):
        control = StoreControl(store, f"test-{sync}")
        os.environ["ROLLHPC_TEST_CORRUPT_WEIGHT_SYNC"] = "4"
        comm.Barrier()
        if rank == 0:
            sender = SlotSender(
                ShmSlots(), control, receivers, SLOT_MB << 20, verify=verify, sync=sync
            )
            named = model.items() if fail_after is None else _failing(model.items(), fail_after)
            try:
                result[name] = sender.send(named).as_dict()
            except Exception as e:  # noqa: BLE001 - the test reads it
                result[name] = {"error": f"{type(e).__name__}: {e}"}
            result[name]["expected"] = _digests(model.items())
        else:
            receiver = SlotReceiver(ShmSlots(), control, rank - 1, f"to version {sync}")
            got = []
            try:
                for i, (n, t) in enumerate(receiver.stream()):
                    if name == "receiver fails" and rank == 1 and i == 20:
                        raise ValueError("engine failed (test)")
                    got.append((n, t.clone()))
                result = {"digests": _digests(got)}
            except Exception as e:  # noqa: BLE001
                receiver.abort(e)
                result = {"error": f"{type(e).__name__}: {e}"}
        gathered = comm.gather(result if rank else None)
        if rank == 0:
            result[name]["receivers"] = gathered[1:]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def test_a_model_13x_the_slot_streams_bitwise_through_two_shm_slots(
    tmp_path,
):
    """Three MPI ranks (mpiexec): rank 0 streams a ~52 MiB model through shared-memory slots of 4 MiB to two
    receivers, six times. The sender's measured peak extra memory (resident high-water mark) stays within
    IN_FLIGHT_BUCKETS x max(slot, largest tensor) (the slots at their peak: one of them 8 MiB for the tensor larger
    than a slot), a third of the model, and no slot file is left; each receiver ends with bit-identical tensors
    (sha256 per tensor, dtypes and shapes). A corrupted bucket stops the sync at its parameter (checksums), a
    receiver failing mid-stream stops the sender with its error, and a sender failing mid-export stops the
    receivers: nobody waits for a timeout."""
    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from rollhpc.weight_sync.buckets import IN_FLIGHT_BUCKETS
    from rollhpc.weight_sync.shared_memory import SLOT_PREFIX

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "slots.json"
    before = set(Path("/dev/shm").glob(SLOT_PREFIX + "*"))
    t = time.perf_counter()
    # glibc's mmap threshold fixed at its default: a large temporary freed leaves the resident set at once (a
    # threshold raised by glibc's own heuristic keeps freed chunks resident in whichever thread's arena), so the
    # high-water mark counts what the sync held, not what the C allocator kept from before
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    res = subprocess.run(
        [
            str(Path(sys.executable).parent / "mpiexec"),
            "-n",
            "3",
            sys.executable,
            "-m",
            "tests.world.test_weight_sync",
            str(out),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    took = time.perf_counter() - t
    got = json.loads(out.read_text())
    model = _slot_model()
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    largest = max(t.numel() * t.element_size() for t in model.values())
    slot = SLOT_MB << 20
    first = got["warm-up"]["peak_extra_bytes"] / 2**20
    print(f"first sync of the process: sender's measured peak extra {first:.1f} MiB")
    for name in ("plain", "doubled"):
        stats = got[name]
        assert stats["bytes"] >= model_bytes and stats["buckets"] >= model_bytes // slot
        assert stats["peak_slot_bytes"] == slot + largest <= IN_FLIGHT_BUCKETS * max(slot, largest)
        # the slots, and on a verified sync the checksum's int64 reduction of one chunk (2 MiB, buckets._CHUNK_ROWS)
        assert stats["peak_extra_bytes"] is not None
        assert (
            stats["peak_extra_bytes"] <= IN_FLIGHT_BUCKETS * max(slot, largest) < model_bytes / 3
        ), (stats["peak_extra_bytes"], model_bytes)
        assert all(r == {"digests": stats["expected"]} for r in stats["receivers"])
        print(
            f"{name}: model {model_bytes / 2**20:.1f} MiB, slots at peak {stats['peak_slot_bytes'] / 2**20:.1f} MiB,"
            f" sender's measured peak extra {stats['peak_extra_bytes'] / 2**20:.1f} MiB, {took:.1f} s in all"
        )
    assert got["corrupt"]["error"].startswith("WeightSyncAborted: weight sync 4: receiver ")
    for r in got["corrupt"]["receivers"]:
        assert r["error"].startswith(
            "WeightSyncMismatch: weight sync to version 4: parameter scalar () "
            "torch.float32 arrived with other bytes"
        ), r
    assert "ValueError: engine failed (test)" in got["receiver fails"]["error"]
    assert got["receiver fails"]["receivers"][0] == {"error": "ValueError: engine failed (test)"}
    assert got["receiver fails"]["receivers"][1]["error"].startswith(
        "WeightSyncAborted: weight sync to version 5: the sender stopped it"
    )
    assert got["sender fails"]["error"] == "RuntimeError: export failed (test)"
    assert all(
        r["error"].endswith("the sender stopped it: RuntimeError: export failed (test)")
        for r in got["sender fails"]["receivers"]
    )
    assert set(Path("/dev/shm").glob(SLOT_PREFIX + "*")) == before


@pytest.mark.slow
def test_rlvr_with_ipc_on_cpu_streams_through_shared_memory_in_sync(tmp_path, tiny_model):
    """``weight_sync: ipc`` on CPU (trainer and generator on one host): the controller starts the trainer's
    ``share_weights`` and the generator's ``receive_shared_weights``, which pass every bucket through the
    trainer's shared-memory slots of 0.25 MiB (the tiny model is many of them) into vLLM, verified at every
    sync; after each the generator's log-probs equal the trainer's. (The torch engine takes the same stream on
    the GPU check's colocated RLVR runs, over CUDA IPC.)"""
    engine = "vllm"
    import json
    from pathlib import Path

    from tests.support.processes import rollhpc
    from tests.world.test_rlvr_pipeline import assert_three_steps_in_sync

    res = rollhpc(
        "train",
        "quickstart",
        f"pipeline.options.model_dir={tiny_model}",
        "pipeline.options.warm_start=null",
        "pipeline.options.steps=3",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.loss.entropy_coef=0.01",
        f"roles.generate.options.engine={engine}",
        "pipeline.options.weight_sync=ipc",
        "pipeline.options.weight_sync_bucket_mb=0.25",
        "pipeline.options.weight_sync_verify_every=1",
        cwd=tmp_path,
        timeout=600,
    )
    run_dir = assert_three_steps_in_sync(res, tmp_path)
    log = (
        (run_dir / "logs" / "rank1-train.log").read_text()
        if (run_dir / "logs" / "rank1-train.log").exists()
        else ""
    )
    assert "Traceback" not in log
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    model_mb = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors")) / (1 << 20)
    # the whole model, streamed through slots of a sixth of its size (the sender's SyncStats)
    for x in steps:
        assert x["weight_sync_mb"] == pytest.approx(model_mb, rel=0.05), (
            x["weight_sync_mb"],
            model_mb,
        )


if __name__ == "__main__":
    import sys

    _slot_world(sys.argv[1])
