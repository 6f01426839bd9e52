"""Bucketed weight sync: packing round trip and the broadcast channel between real processes (gloo)."""

from __future__ import annotations

import socket

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
    ch = WeightBroadcast(rank, 3, "127.0.0.1", port)
    for round_ in range(2):
        out[(rank, round_)] = {n: t.clone() for n, t in ch.receive()}


def test_broadcast_reaches_every_generator_bitwise():
    store = open_store(timeout_s=60)
    out = mp.Manager().dict()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver, args=(r, store.port, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    sender = WeightBroadcast(0, 3, "", 0, store=store)
    w = _weights()
    sent = sender.send(pack_buckets(w.items(), bucket_bytes=256))
    w2 = {k: v * 2 for k, v in w.items()}
    sender.send(pack_buckets(w2.items(), bucket_bytes=1 << 20))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sent == sum(t.numel() * t.element_size() for t in w.values())
    for rank in (1, 2):
        for round_, ref in enumerate((w, w2)):
            got = out[(rank, round_)]
            assert got.keys() == ref.keys()
            assert all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)


def test_auto_weight_sync_takes_cuda_ipc_only_when_every_generator_shares_the_trainers_gpu():
    from rollhpc.launch.device_mapping import RankPlacement, WorldPlan
    from rollhpc.weight_sync.driver import choose_mode

    def plan(*ranks: tuple[str, int, int, int, tuple[int, ...]]) -> WorldPlan:
        return WorldPlan([RankPlacement(i, role, g, comp, node, gpus) for i, (role, g, comp, node, gpus)
                          in enumerate([("controller", 0, 0, 0, ()), *ranks])], [])

    one_gpu = plan(("train", 0, 1, 0, (0,)), ("generate", 0, 1, 0, (0,)))
    assert choose_mode("auto", one_gpu) == "ipc"
    assert choose_mode("broadcast", one_gpu) == "broadcast" and choose_mode("relay", one_gpu) == "relay"
    spread = plan(("train", 0, 1, 0, (0,)), ("train", 1, 1, 0, (1,)), ("generate", 0, 1, 0, (0,)),
                  ("generate", 1, 1, 0, (1,)))  # colocated, but generator 1 is on another GPU than trainer 0
    assert choose_mode("auto", spread) == "broadcast"
    apart = plan(("train", 0, 1, 0, (0,)), ("generate", 0, 2, 0, (0,)))  # GPU 0 of another het group's node
    assert choose_mode("auto", apart) == "broadcast"
    cpu = plan(("train", 0, 0, 0, ()), ("generate", 0, 0, 0, ()))
    assert choose_mode("auto", cpu) == "broadcast"
