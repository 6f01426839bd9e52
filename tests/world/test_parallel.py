import subprocess
import sys

import pytest

from rollhpc.parallel import DENSE_GROUP_KINDS, EXPERT_GROUP_KINDS, ParallelLayout


def test_tp_is_fastest_then_cp_then_dp_then_pp():
    layout = ParallelLayout(world=16, tp=2, cp=2, pp=2)  # dp = 2
    c = layout.coords(0b1011)  # 11 = tp 1, cp 1, dp 0, pp 1
    assert (c.tp_rank, c.cp_rank, c.dp_rank, c.pp_rank) == (1, 1, 0, 1)
    assert layout.coords(4).dp_rank == 1 and layout.coords(8).pp_rank == 1
    leaders = [c.group_rank for c in layout.all_coords() if c.is_dp_leader]
    assert leaders == [8, 12]  # tp 0, cp 0, last stage, one per dp rank


def test_every_rank_has_a_unique_position():
    layout = ParallelLayout(world=24, tp=2, cp=1, pp=3)
    seen = {(c.tp_rank, c.cp_rank, c.dp_rank, c.pp_rank) for c in layout.all_coords()}
    assert len(seen) == 24 and layout.dp == 4


def test_dense_groups_follow_megatron():
    layout = ParallelLayout(world=8, tp=2, pp=2)  # dp = 2
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # megatron's model-parallel group
    assert layout.groups("cp") == [[r] for r in range(8)]
    assert layout.groups("tp-dp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_groups_with_context_and_expert_parallelism():
    # What megatron-core 0.16's initialize_model_parallel builds for these sizes.
    layout = ParallelLayout(world=16, tp=2, pp=2, cp=2, ep=2, vpp=2)  # dp = 2, etp = 2, edp = 2
    assert layout.groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    # token order inside a kind is irrelevant
    assert layout.groups("cp-dp") == layout.groups("dp-cp")
    assert layout.groups("tp-dp") == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert layout.groups("tp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.groups("expert-ep")[:2] == [[0, 2], [1, 3]]
    assert layout.groups("expert-tp")[:2] == [[0, 1], [2, 3]]
    assert layout.groups("expert-dp")[:2] == [[0, 4], [1, 5]]
    assert layout.groups("expert-tp-ep") == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    assert layout.groups("expert-tp-ep-pp") == [
        [0, 1, 2, 3, 8, 9, 10, 11],
        [4, 5, 6, 7, 12, 13, 14, 15],
    ]
    assert layout.groups("expert-pp") == layout.groups("pp")
    c = layout.coords(6)  # dense: tp 0, cp 1, dp 1; expert: etp 0, ep 1, edp 1
    assert (c.tp_rank, c.cp_rank, c.dp_rank, c.pp_rank) == (0, 1, 1, 0)
    assert (c.etp_rank, c.ep_rank, c.edp_rank) == (0, 1, 1)


def test_expert_tensor_parallel_size_defaults_to_tp():
    layout = ParallelLayout(world=16, tp=2, ep=4)
    assert layout.etp == 2 and layout.edp == 2
    assert layout == ParallelLayout(world=16, tp=2, ep=4, etp=2)
    moe = ParallelLayout(world=16, tp=2, ep=4, etp=1)
    assert moe.edp == 4 and moe.groups("expert-ep")[0] == [0, 1, 2, 3]


def test_custom_order():
    layout = ParallelLayout(world=8, tp=2, pp=2, order="TP-PP-DP")  # ep and cp (size 1) appended
    assert layout.order == "tp-pp-dp" and layout.rank_order == ("tp", "pp", "dp", "cp", "ep")
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.coords(2).pp_rank == 1 and layout.coords(4).dp_rank == 1


def test_group_kinds_are_documented_and_partition_the_ranks():
    layout = ParallelLayout(world=32, tp=2, pp=2, cp=2, ep=2, etp=1)
    assert ParallelLayout.GROUP_KINDS == DENSE_GROUP_KINDS + EXPERT_GROUP_KINDS
    for kind in layout.GROUP_KINDS:
        assert sorted(r for g in layout.groups(kind) for r in g) == list(range(32)), kind


@pytest.mark.parametrize(
    "kind,msg",
    [
        ("ep", "unknown group kind 'ep' .*'expert-ep'"),
        ("expert-cp", "unknown group kind 'expert-cp'"),
        ("tp-tp", "unknown group kind 'tp-tp'"),
        ("", "unknown group kind ''"),
    ],
)
def test_unknown_group_kinds_are_refused(kind, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelLayout(world=4, tp=2).groups(kind)


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"world": 6, "tp": 4}, "6 ranks cannot be split into tp=4 x cp=1 x pp=1 .*multiple of 4"),
        ({"world": 4, "tp": 0}, "tp must be >= 1, got 0"),
        ({"world": 4, "ep": 3}, r"4 ranks cannot be split into etp=1 x ep=3 x pp=1 \(= 3\) expert"),
        ({"world": 8, "tp": 2, "ep": 4, "etp": 4}, r"etp=4 x ep=4 x pp=1 \(= 16\).*multiple of 16"),
        ({"world": 8, "tp": 2, "ep": 8}, r"etp=2 x ep=8 x pp=1 \(= 16\).*\(etp defaults to tp\)"),
        ({"world": 8, "etp": 0}, "etp must be >= 1, got 0"),
        ({"world": 8, "vpp": 0, "pp": 2}, "vpp must be >= 1, got 0"),
        ({"world": 8, "vpp": 2}, r"vpp=2 \(interleaved pipeline schedule\) needs pp > 1, got pp=1"),
        ({"world": 8, "order": "tp-xp-dp"}, "order 'tp-xp-dp': unknown token.*'xp'"),
        ({"world": 8, "order": "tp-dp-tp"}, "order 'tp-dp-tp' names a token twice"),
        (
            {"world": 8, "cp": 2, "order": "tp-dp-pp"},
            "leaves out 'cp', but the dense grid has cp=2",
        ),
        (
            {"world": 8, "ep": 2, "order": "tp-cp-dp-pp"},
            "leaves out 'ep', but the expert grid has ep=2",
        ),
        (
            {"world": 8, "tp": 2, "order": "tp-ep-pp"},
            "leaves out 'dp', but the dense grid has dp=4",
        ),
        (
            {"world": 8, "tp": 2, "ep": 2, "etp": 1, "order": "cp-ep-dp-pp"},
            "leaves out 'tp', but the dense grid has tp=2",
        ),
        (
            {"world": 16, "tp": 2, "pp": 2, "ep": 2, "order": "tp-cp-ep-pp-dp"},
            "does not put pp last.*dp=4 .* and edp=2",
        ),
        (
            {"world": 16, "tp": 2, "cp": 2, "pp": 2, "ep": 2, "order": "tp-ep-pp-cp-dp"},
            "different pipeline groups \\(pipeline stages 2 ranks apart vs 4\\)",
        ),
    ],
)
def test_impossible_layouts_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelLayout(**kw)


def test_coords_outside_the_group():
    with pytest.raises(IndexError, match="rank 4 outside a group of 4"):
        ParallelLayout(world=4).coords(4)


def test_large_world_is_cheap():
    layout = ParallelLayout(world=4096, tp=8, pp=4, cp=2, ep=8, etp=1, vpp=2)
    coords = layout.all_coords()
    assert sum(c.is_dp_leader for c in coords) == layout.dp == 64
    for kind in layout.GROUP_KINDS:
        assert sum(len(g) for g in layout.groups(kind)) == 4096


def test_module_needs_neither_torch_nor_megatron():
    code = (
        "import sys, rollhpc.parallel; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pipeline_stage_layers_follow_megatron():
    """Even splits; with virtual stages chunk v of stage s holds block v * pp + s (what megatron built
    in tests/world/test_pipeline_parallel.py: the first of 2 stages x 2 chunks of 4 layers held layers 0 and 2)."""
    from rollhpc.parallel import pipeline_stage_layers

    assert pipeline_stage_layers(4, 2) == [[range(0, 2)], [range(2, 4)]]
    assert pipeline_stage_layers(4, 2, 2) == [
        [range(0, 1), range(2, 3)],
        [range(1, 2), range(3, 4)],
    ]
    assert pipeline_stage_layers(8, 2, 2)[1] == [range(2, 4), range(6, 8)]
    with pytest.raises(ValueError, match="6 layers cannot be split evenly into pp=2 x vpp=2"):
        pipeline_stage_layers(6, 2, 2)


def test_micro_batches_pad_interleaved_schedules_to_whole_groups():
    from rollhpc.workers.megatron_batches import micro_batches

    assert [m.tolist() for m in micro_batches(5, 2)] == [[0, 1], [2, 3], [4]]
    assert micro_batches(0, 2) == []
    # interleaved, pp=2: at least 2 micro-batches, a multiple of 2, all of one shape; -1 pads
    assert [m.tolist() for m in micro_batches(5, 2, pp=2, interleaved=True)] == [
        [0, 1],
        [2, 3],
        [4, -1],
        [-1, -1],
    ]
    assert [m.tolist() for m in micro_batches(1, 4, pp=2, interleaved=True)] == [[0], [-1]]
    assert [m.tolist() for m in micro_batches(6, 2, pp=2, interleaved=True)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [-1, -1],
    ]
