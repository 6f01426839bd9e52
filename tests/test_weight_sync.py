"""Bucketed weight sync: packing round trip and the broadcast channel between real processes (gloo)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from rollhpc.weight_sync.broadcast import WeightBroadcast, open_store
from rollhpc.weight_sync.buckets import pack_buckets, unpack_bucket


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 4, generator=g), "b": torch.randn(100, generator=g).to(torch.bfloat16),
            "c": torch.randn(7, 5, generator=g), "d": torch.arange(6, dtype=torch.float32).view(2, 3)}


def test_buckets_round_trip_bitwise_and_respect_the_size():
    w = _weights()
    buckets = list(pack_buckets(w.items(), bucket_bytes=64))  # smaller than most tensors: one bucket each
    assert all(len({b.data.dtype}) == 1 for b in buckets)
    assert sum(len(b.names) for b in buckets) == len(w)
    back = {n: t for b in buckets for n, t in unpack_bucket(b)}
    assert back.keys() == w.keys() and all(torch.equal(back[k], w[k]) and back[k].dtype == w[k].dtype for k in w)
    (one,) = [b for b in pack_buckets(w.items(), bucket_bytes=1 << 20) if b.data.dtype == torch.float32]
    assert one.names == ["a", "c", "d"] and one.nbytes == (12 + 35 + 6) * 4


def _receiver(rank: int, port: int, out: dict) -> None:
    from rollhpc.weight_sync.buckets import WeightSyncMismatch

    ch = WeightBroadcast(rank, 3, "127.0.0.1", port)
    for round_ in range(3):
        try:
            out[(rank, round_)] = {n: t.clone() for n, t in ch.receive()}
        except WeightSyncMismatch as e:
            out[(rank, round_)] = str(e)
            for _ in ch.receive():  # the rest of the stream, as a worker ends its call before the run stops
                pass


def test_broadcast_reaches_every_generator_bitwise_and_a_corrupted_bucket_is_named(monkeypatch):
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
    sent = sender.send(pack_buckets(w.items(), bucket_bytes=256), verify=True)
    w2 = {k: v * 2 for k, v in w.items()}
    sender.send(pack_buckets(w2.items(), bucket_bytes=1 << 20))
    sender.send(pack_buckets(w.items(), bucket_bytes=256), verify=True)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sent == sum(t.numel() * t.element_size() for t in w.values())
    for rank in (1, 2):
        for round_, ref in enumerate((w, w2)):
            got = out[(rank, round_)]
            assert got.keys() == ref.keys()
            assert all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)
        assert out[(rank, 2)].startswith("weight sync 3: parameter a (3, 4) torch.float32 arrived with other bytes "
                                         "than the trainer sent (checksum 0x"), out[(rank, 2)]


def test_the_checksum_is_exact_order_sensitive_and_the_same_on_any_layout():
    from rollhpc.weight_sync.buckets import tensor_checksum

    t = torch.randn(1001, generator=torch.Generator().manual_seed(1))
    assert tensor_checksum(t) == tensor_checksum(t.clone()) == tensor_checksum(t.view(7, 143).t().contiguous().t())
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

    return WorldPlan([RankPlacement(i, role, g, comp, node, gpus) for i, (role, g, comp, node, gpus)
                      in enumerate([("controller", 0, 0, 0, ()), *ranks])], [])


def assert_valid_routing(plan, routing) -> None:
    """Every generator rank has exactly one route, from the trainer's rank 0; an IPC route is on that rank's GPU;
    the broadcast group (the trainer's rank 0 and the generators it serves) never holds two ranks of one GPU."""
    from rollhpc.weight_sync.routing import BROADCAST, IPC

    source = next(p for p in plan.ranks if p.role == "train" and p.group_rank == 0)
    home = (source.component, source.node, source.gpus[0]) if source.gpus else None
    gens = sorted(p.group_rank for p in plan.ranks if p.role == "generate")
    assert sorted(r.generator for r in routing.routes) == gens
    assert all(r.source == 0 for r in routing.routes)
    assert all(r.place == home and home is not None for r in routing.routes if r.transport == IPC)
    members = [home] + [r.place for r in routing.routes if r.transport == BROADCAST]
    on_gpus = [m for m in members if m is not None]
    assert len(on_gpus) == len(set(on_gpus)), members


def test_each_generator_gets_cuda_ipc_on_the_trainers_gpu_and_the_broadcast_group_elsewhere():
    """``auto`` routes per generator rank: CUDA IPC where it shares the GPU of the trainer's rank 0 (same het
    group, node, GPU), the broadcast group everywhere else; a layout that would put two ranks of one GPU into
    the broadcast group (NCCL refuses it) is refused, as is ``ipc`` forced on a generator elsewhere."""
    from rollhpc.weight_sync.routing import RoutingError, route_weights

    one_gpu = _plan(("train", 0, 1, 0, (0,)), ("generate", 0, 1, 0, (0,)))
    assert route_weights(one_gpu).mode == "ipc"
    with pytest.raises(RoutingError, match="set pipeline.options.weight_sync=auto"):
        route_weights(one_gpu, "broadcast")  # two ranks of GPU 0 in one NCCL group
    spread = _plan(("train", 0, 1, 0, (0,)), ("train", 1, 1, 0, (1,)), ("generate", 0, 1, 0, (0,)),
                   ("generate", 1, 1, 0, (1,)))  # colocated, but generator 1 is on another GPU than trainer 0
    routing = route_weights(spread)
    assert routing.mode == "mixed" and routing.ranks("ipc") == [0] and routing.ranks("broadcast") == [1]
    assert_valid_routing(spread, routing)
    with pytest.raises(RoutingError, match="trainer's rank 0 and generate rank 0 would both be in the broadcast "
                                           "group on GPU 0 of node 0 in het group 1, and NCCL refuses"):
        route_weights(spread, "broadcast")  # the old choice for this layout: a failure at the first sync
    with pytest.raises(RoutingError, match="weight_sync=ipc needs every generator on the GPU of the trainer's rank 0"):
        route_weights(spread, "ipc")
    apart = _plan(("train", 0, 1, 0, (0,)), ("generate", 0, 2, 0, (0,)))  # GPU 0 of another het group's node
    assert route_weights(apart).mode == "broadcast"
    cpu = _plan(("train", 0, 0, 0, ()), ("generate", 0, 0, 0, ()), ("generate", 1, 0, 0, ()))
    assert route_weights(cpu).mode == "broadcast"  # gloo: no GPU to share
    two_on_one = _plan(("train", 0, 1, 0, (0,)), ("generate", 0, 2, 0, (3,)), ("generate", 1, 2, 0, (3,)))
    with pytest.raises(RoutingError, match="generate rank 0 and generate rank 1 would both be in the broadcast"):
        route_weights(two_on_one)
    assert route_weights(two_on_one, "relay").mode == "broadcast"  # relay forms no group: nothing to refuse


@pytest.mark.parametrize("name, overrides, ipc", [
    ("qwen2.5-7b_grpo", [], [0]),
    ("qwen3-30b-a3b_grpo", [], None),
    ("qwen2.5-0.5b_gsm8k", [], None),
    ("moe_4096_selfcheck", [], [0]),  # generator 0 on node 0's 8 GPUs, 511 others in a group of 512
    # partial overlap: the trainer on half of the generators' GPUs, its rank 0 on GPU 2 (generator 1's first GPU)
    ("qwen2.5-7b_grpo", ["roles.train.procs=8", "roles.train.devices=[2,3,0,1,4,5,6,7]", "roles.reference.procs=8",
                         "roles.reference.devices=[0,1,2,3,4,5,6,7]", "pipeline.options.rollout.max_staleness=1"], [1]),
], ids=["7b", "30b", "0.5b", "moe4096", "partial-overlap"])
def test_shipped_layouts_route_every_generator_once_and_no_group_holds_two_ranks_of_a_gpu(name, overrides, ipc):
    from rollhpc.cli import load_experiment
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
    from tests.conftest import rollhpc

    res = rollhpc("plan", "qwen2.5-7b_grpo", "--no-ranks", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split("weight sync (auto: mixed), per generator rank:\n")[1].splitlines()
    assert lines[0].split() == ["generate", "0", "<-", "train", "rank", "0:", "CUDA", "IPC", "(same", "GPU,", "device",
                                "to", "device);", "receives", "on", "het", "group", "1", "node", "0", "GPU", "0;",
                                "size", "unknown", "(no", "config.json", "here)"]
    assert "generate   7 <- train rank 0: broadcast (NCCL, group of 8); receives on het group 1 node 1 GPU 6;" in \
        res.stdout
