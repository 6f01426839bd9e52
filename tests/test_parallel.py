import pytest

from rollhpc.parallel import ParallelLayout


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


@pytest.mark.parametrize("kw,msg", [
    ({"world": 6, "tp": 4}, "multiple of 4"),
    ({"world": 4, "tp": 0}, "tp must be >= 1"),
    ({"world": 4, "ep": 3}, "ep=3 must divide"),
])
def test_impossible_layouts_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelLayout(**kw)
