"""ParallelLayout against megatron-core itself: its RankGenerator and initialize_model_parallel.

rollhpc.parallel is pure Python; here megatron-core (CPU build, no torch.distributed) says what the
groups must be. Random layouts are seeded, so a failure reproduces.
"""

from __future__ import annotations

import math
import random
import warnings

import pytest

from rollhpc.parallel import DENSE_GROUP_KINDS, EXPERT_GROUP_KINDS, ParallelLayout

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" and the like
    ps = pytest.importorskip("megatron.core.parallel_state")
torch = pytest.importorskip("torch")

TOKENS = ("tp", "cp", "ep", "dp", "pp")
# initialize_model_parallel's group_desc for each of our kinds.
DESC = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "DATA_PARALLEL_GROUP": "dp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "MODEL_PARALLEL_GROUP": "tp-pp",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp-cp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp-cp",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp-dp-cp",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp-dp",
    "EXPERT_TENSOR_PARALLEL_GROUP": "expert-tp",
    "EXPERT_MODEL_PARALLEL_GROUP": "expert-ep",
    "EXPERT_DATA_PARALLEL_GROUP": "expert-dp",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "expert-tp-ep",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "expert-tp-ep-pp",
}
# The RankCoords field holding a rank's position along each token, per grid.
ATTR = {
    False: {"tp": "tp_rank", "cp": "cp_rank", "dp": "dp_rank", "pp": "pp_rank"},
    True: {"tp": "etp_rank", "ep": "ep_rank", "dp": "edp_rank", "pp": "pp_rank"},
}
BIG = [  # world = 4096, always checked
    dict(world=4096, tp=8, pp=4, cp=2, ep=8, etp=1, vpp=4, order="tp-cp-ep-dp-pp"),
    dict(world=4096, tp=4, pp=8, cp=1, ep=16, etp=2, vpp=None, order="tp-cp-ep-dp-pp"),
    dict(world=4096, tp=1, pp=1, cp=1, ep=64, etp=1, vpp=None, order="tp-cp-ep-dp-pp"),
    dict(world=4096, tp=2, pp=16, cp=4, ep=4, etp=2, vpp=2, order="tp-cp-ep-dp-pp"),
]


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _random_case(rng: random.Random) -> dict:
    while True:
        tp, pp, cp = (
            rng.choice([1, 1, 2, 2, 4, 8, 3]),
            rng.choice([1, 1, 2, 3, 4, 8]),
            rng.choice([1, 1, 2, 4]),
        )
        dp = rng.choice([1, 2, 3, 4, 6, 8, 16, 32, 64])
        world = tp * pp * cp * dp
        if world <= 4096:
            break
    if rng.random() < 0.05:
        world += rng.choice([1, 2, tp])  # often not a multiple of tp x cp x pp any more
    etp = tp if rng.random() < 0.4 else rng.choice(_divisors(max(world // pp, 1), 16))
    ep = rng.choice(_divisors(max(world // (pp * etp), 1), 64))
    if rng.random() < 0.05:
        ep = rng.randint(1, 8)  # may not divide
    r = rng.random()
    if r < 0.55:
        order = "tp-cp-ep-dp-pp"
    else:
        tokens = list(TOKENS)
        rng.shuffle(tokens)
        if r > 0.85:  # leave some out; fine only where those have size 1
            tokens = [t for t in tokens if rng.random() < 0.7] or ["tp"]
        order = "-".join(tokens)
    vpp = rng.choice([None, None, 2, 3]) if pp > 1 or rng.random() < 0.05 else None
    return dict(world=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, order=order)


def _cases(n_valid: int = 200, seed: int = 20240601) -> list[dict]:
    rng = random.Random(seed)
    out, valid = [], 0
    while valid < n_valid:
        out.append(_random_case(rng))
        valid += _megatron_generators(out[-1]) is not None
    return out


def _megatron_generators(case: dict):
    """(dense, expert) RankGenerators the way initialize_model_parallel builds them, or None where
    megatron refuses the layout (same checks, in the same order)."""
    world, tp, pp, cp, ep, etp, order = (
        case[k] for k in ("world", "tp", "pp", "cp", "ep", "etp", "order")
    )
    if world % (tp * pp * cp) or world % (etp * ep * pp) or (case["vpp"] is not None and pp == 1):
        return None
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    try:
        dense = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        expert = ps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    except RuntimeError:  # a token of size > 1 missing from the order
        return None
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return None
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        return None
    return dense, expert


def _layout_or_none(case: dict) -> ParallelLayout | None:
    try:
        return ParallelLayout(**case)
    except ValueError:
        return None


def _check_coords_against_groups(layout: ParallelLayout) -> None:
    """Each group partitions the ranks; inside a group, ranks agree on every coordinate the kind
    leaves out and their positions are the mixed-radix number of the coordinates it names (so a tp
    group lists tp ranks 0..tp-1 in order, as megatron's get_tensor_model_parallel_rank would say)."""
    coords = layout.all_coords()
    sizes = {
        False: {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp},
        True: {"tp": layout.etp, "ep": layout.ep, "dp": layout.edp, "pp": layout.pp},
    }
    for kind in layout.GROUP_KINDS:
        expert = kind.startswith("expert-")
        named = set(kind.removeprefix("expert-").split("-"))
        inside = [t for t in layout.rank_order if t in named]  # fastest first
        outside = [ATTR[expert][t] for t in ATTR[expert] if t not in named]
        groups = layout.groups(kind)
        size = math.prod(sizes[expert][t] for t in named)
        assert len(groups) * size == layout.world and all(len(g) == size for g in groups), kind
        assert len({r for g in groups for r in g}) == layout.world, kind
        for g in groups:
            first = coords[g[0]]
            for pos, r in enumerate(g):
                c = coords[r]
                assert c.group_rank == r
                assert all(getattr(c, a) == getattr(first, a) for a in outside), (kind, g)
                x, m = 0, 1
                for t in inside:
                    x, m = x + getattr(c, ATTR[expert][t]) * m, m * sizes[expert][t]
                assert x == pos, (kind, g, r)
    leaders = [c for c in coords if c.is_dp_leader]
    assert sorted(c.dp_rank for c in leaders) == list(range(layout.dp))
    assert all(c.dp_size == layout.dp for c in coords)


def test_random_layouts_match_rank_generator():
    cases = _cases()
    refused = 0
    for case in cases + BIG:
        gens, layout = _megatron_generators(case), _layout_or_none(case)
        assert (gens is None) == (layout is None), case
        if gens is None:
            refused += 1
            continue
        dense, expert = gens
        for kind in DENSE_GROUP_KINDS:
            assert layout.groups(kind) == dense.get_ranks(kind), (case, kind)
        for kind in EXPERT_GROUP_KINDS:
            assert layout.groups(kind) == expert.get_ranks(kind.removeprefix("expert-")), (
                case,
                kind,
            )
        assert layout.groups("expert-pp") == layout.groups("pp")
        _check_coords_against_groups(layout)
    assert refused >= 10  # the refusals were exercised too


@pytest.fixture
def megatron_init(monkeypatch):
    """Run the real initialize_model_parallel on a fake torch.distributed world (rank 0) and return
    the groups it asked for, by our kind names."""

    def run(case: dict) -> dict[str, list[list[int]]]:
        got: dict[str, list[list[int]]] = {}

        def new_group(ranks=None, group_desc=None, **_):
            if group_desc in DESC:
                got.setdefault(DESC[group_desc], []).append(list(ranks))
            return object()

        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: case["world"])
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(torch.distributed, "new_group", new_group)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=case["tp"],
                pipeline_model_parallel_size=case["pp"],
                virtual_pipeline_model_parallel_size=case["vpp"],
                context_parallel_size=case["cp"],
                expert_model_parallel_size=case["ep"],
                expert_tensor_parallel_size=case["etp"],
                order=case["order"],
                create_gloo_process_groups=False,
            )
        finally:
            ps.destroy_model_parallel()
        return got

    return run


def test_layouts_match_initialize_model_parallel(megatron_init):
    """End to end: the groups megatron creates, and the layouts it refuses, for a sample of layouts."""
    rng = random.Random(7)
    cases = [c for c in (_random_case(rng) for _ in range(400)) if c["world"] <= 512][:60] + BIG[:1]
    created = 0
    for case in cases:
        layout = _layout_or_none(case)
        try:
            got = megatron_init(case)
        except (RuntimeError, AssertionError):
            assert layout is None, case
            continue
        assert layout is not None, case
        assert set(got) == set(DESC.values())
        for kind, groups in got.items():
            assert layout.groups(kind) == groups, (case, kind)
        created += 1
    assert created >= 20
