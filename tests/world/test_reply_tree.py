"""Replies along a reply tree (rollhpc.transport.reply_tree): its shape, its bundles, and real MPI worlds whose
calls go to controller.reply_tree_min_ranks or more (11 ranks, fan-in 3: not a power of two, three levels)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from rollhpc.config import ConfigError, ControllerConfig
from rollhpc.transport.reply_tree import CONTROLLER, Bundle, build_reply_tree
from tests.support.processes import assert_no_orphans, rollhpc
from tests.world.test_mpi_world import fail_world


def _path(tree, r: int) -> list[int]:
    out = [r]
    while out[-1] != CONTROLLER:
        out.append(tree.parent[out[-1]])
    return out


@pytest.mark.parametrize(
    "n,per_host,fan_in", [(11, 11, 3), (13, 4, 2), (40, 8, 5), (17, 3, 16), (8769, 8, 16)]
)
def test_every_rank_reaches_the_controller_once_via_its_node_leader(n, per_host, fan_in):
    ranks = list(range(1, n + 1))
    hosts = {r: f"node{(r - 1) // per_host}" for r in ranks}
    tree = build_reply_tree(ranks, hosts, fan_in)
    assert sorted(tree.parent) == ranks
    counted = [c for kids in tree.children.values() for c in kids]
    # each collected once
    assert sorted(counted + [r for r in ranks if tree.parent[r] == CONTROLLER]) == ranks
    tops = [r for r in ranks if tree.parent[r] == CONTROLLER]
    assert 1 <= len(tops) <= fan_in
    depth = tree.depth()  # finite: no cycles
    assert all(
        len(_path(tree, r)) <= 1 + depth
        and (tree.parent[r] == CONTROLLER or tree.parent[r] in tree.children)
        for r in ranks
    )
    # a rank that is not a node leader is collected by its own node's leader
    leaders = (
        {min(r for r in ranks if hosts[r] == h) for h in set(hosts.values())}
        if fan_in >= per_host
        else None
    )
    if leaders is not None:
        assert all(hosts[tree.parent[r]] == hosts[r] for r in ranks if r not in leaders)
    if n == 8769:  # the 4096-GPU self-check's world: 5 messages to the controller instead of 8,769
        assert len(tops) == 5 and depth == 4
        assert max(len(k) for k in tree.children.values()) <= depth * (fan_in - 1)


def test_a_fan_in_below_two_is_refused():
    with pytest.raises(ValueError, match="fan-in of 2"):
        build_reply_tree([1, 2, 3], {1: "a", 2: "a", 3: "a"}, 1)
    with pytest.raises(ConfigError, match="controller.reply_fan_in"):
        ControllerConfig(reply_fan_in=1)
    with pytest.raises(ConfigError, match="controller.reply_tree_min_ranks"):
        ControllerConfig(reply_tree_min_ranks=-1)


def test_bundles_merge_and_travel_as_one_message_with_their_arrays_aligned():
    import torch

    f64, i8 = np.arange(2001, dtype=np.float64), np.arange(3333, dtype=np.int8)
    bf16 = torch.arange(5000, dtype=torch.bfloat16)
    singles = [
        Bundle.of_reply(
            3, {"call_s": 0.5, "cpu_s": 2.0, "released": ["/dev/shm/x"]}, {"x": f64, "n": 3}
        ),
        Bundle.of_reply(4, {"call_s": 0.25, "cpu_s": 1.0}, None),
        Bundle.of_reply(5, {"call_s": 0.125, "cpu_s": 3.0}, [bf16, i8]),
    ]
    merged = Bundle.merge([Bundle.merge(singles[:2]), Bundle.merge([]), singles[2]])
    envelope, data = merged.encode(7)
    # both travel raw
    assert envelope["call_id"] == 7 and data.nbytes >= f64.nbytes + bf16.numel() * 2
    got = Bundle.decode(envelope, data)
    assert (
        got.ranks == [3, 4, 5] and got.call_s == [0.5, 0.25, 0.125] and got.cpu_s == [2.0, 1.0, 3.0]
    )
    assert got.released == {3: ["/dev/shm/x"]}
    assert np.array_equal(got.results[0]["x"], f64) and got.results[0]["x"].flags.aligned
    assert got.results[0]["n"] == 3 and got.results[1] is None
    assert torch.equal(got.results[2][0], bf16) and np.array_equal(got.results[2][1], i8)


def tree_world(**controller) -> dict:
    return {"controller": {"reply_tree_min_ranks": 4, "reply_fan_in": 3, **controller}}


def test_calls_on_a_group_larger_than_the_fan_in_come_back_along_the_tree(experiment, tmp_path):
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:ReplyTreeScenario"},
            "roles": {
                "probe": {"worker": "rollhpc.workers.diagnostic:DiagnosticWorker", "procs": 11}
            },
            **tree_world(),
        }
    )
    res = rollhpc("train", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads((run_dir / "scenario.json").read_text())
    assert out["ping_ranks"] == list(range(1, 12))  # each reply filed under its own rank
    # two top relays (ranks 1 and 10), not 11 replies
    assert out["ping_messages"] == out["echo_messages"] == 2
    assert out["echo"] == [{"a": 1}] * 11 and out["arrays_ok"]
    assert out["tagged_dp"] == [0, 0, 0] + [d for d in range(1, 11) for _ in range(2)]
    assert out["count_items"] == [[d, 2] for d in range(11)]
    assert out["checksum_ok"] and out["shared_reused"] >= 1
    # a direct reply overtook the relayed ones of the call before it, and both calls got their results
    assert out["alone"] == 10 and out["group_done_when_alone_was"] is False
    assert out["group"] == list(range(1, 12))
    assert (
        "replies of calls to 11 ranks go along a tree: 2 messages to the controller, depth 3"
        in res.stderr
    )
    assert_no_orphans(run_dir)


def failing_tree_world(experiment, tmp_path, how: str, **extra) -> tuple[str, str, object]:
    """FailScenario on 11 ranks along a reply tree of fan-in 3 (rank 1 collects ranks 2, 3, 4 and 7; rank 4
    collects 5 and 6, rank 7 8 and 9; rank 10 collects 11): (stderr, its last line, run dir), once the run
    failed well within the test's limit."""
    path, run_dir = experiment(
        {
            **fail_world(how, **extra),
            "roles": {
                "probe": {"worker": "rollhpc.workers.diagnostic:DiagnosticWorker", "procs": 11}
            },
            **tree_world(),
        }
    )
    start = time.monotonic()
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=120)
    assert res.returncode == 1, res.stderr[-4000:]
    assert time.monotonic() - start < 60
    return res.stderr, res.stderr.strip().splitlines()[-1], run_dir


def test_an_error_under_a_busy_relay_reaches_the_controller_at_once(experiment, tmp_path):
    # group rank 4 (world rank 5) sits under relay 4, under relay 1; every other rank is busy for 120 s
    _, last, run_dir = failing_tree_world(
        experiment, tmp_path, "raise", rank=4, others_sleep_s=120.0
    )
    assert (
        "worker rank 5 (role 'probe', group rank 4" in last
        and "deliberate failure for the test" in last
    )
    assert_no_orphans(run_dir)


def test_a_relay_that_dies_mid_call_is_named_and_nothing_hangs(experiment, tmp_path):
    # world rank 1, the top relay
    _, last, run_dir = failing_tree_world(experiment, tmp_path, "crash", rank=0)
    assert (
        "worker rank 1 (role 'probe', group rank 0" in last
        and "died while running 'crash_on'" in last
    )
    assert json.loads((run_dir / "error.json").read_text())["type"] == "WorkerDied"
    assert_no_orphans(run_dir)


def test_a_call_hung_on_a_leaf_names_its_relays_ranks_and_dumps_stacks(experiment, tmp_path):
    # group rank 4 (world rank 5) hangs: its relay (rank 4) waits for it, and rank 4's relay (rank 1) for rank 4
    _, last, run_dir = failing_tree_world(experiment, tmp_path, "hang", rank=4, timeout_s=3.0)
    # the subtree under rank 1 (ranks 1-9) has not reached rank 0; ranks 10 and 11 have, through their own relay
    assert (
        "call 'hang_on' on role 'probe': no reply within 3 s from rank 1 (role 'probe', group rank 0"
        in last
    )
    assert "rank 10 (" not in last and "its relay not yet" in last
    (stacks,) = (run_dir / "logs").glob("stacks-*.txt")
    text = stacks.read_text()
    assert all(f"=== rank {r} (role 'probe'" in text for r in range(1, 12))
    # the hung leaf, and the relays waiting on it
    assert "in hang_on" in text and "in _collect" in text
    assert_no_orphans(run_dir)
