"""Parallel layout of one role: where each of its ranks sits in megatron-core's 5D grid.

A role's ``world`` ranks are numbered like megatron-core numbers its global ranks: a mixed-radix
number whose digits follow ``order`` (default ``"tp-cp-ep-dp-pp"``, the first token varying fastest),
so tensor-parallel peers are neighbours (they share a node) and pipeline stages are farthest apart.
Plain values, no globals, no megatron or torch import: the controller and ``rollhpc plan`` compute
every role's layout on a login node.

As in ``megatron.core.parallel_state.initialize_model_parallel`` the same ranks are read twice:

* the dense (attention) grid: sizes tp, cp, dp, pp with ``dp = world // (tp * cp * pp)``; the ``ep``
  digit has size 1 there;
* the expert (MoE) grid: sizes etp (in the ``tp`` slot of ``order``), ep, edp (in the ``dp`` slot),
  pp, with ``edp = world // (etp * ep * pp)``; the ``cp`` digit has size 1 there.

``ParallelLayout.groups(kind)`` returns the process groups of one kind exactly as megatron's
``RankGenerator.get_ranks(token)`` lists them (same group order, same rank order inside a group).
``kind`` is a hyphen-joined set of tokens; token order inside ``kind`` does not matter:

* dense kinds: any combination of ``tp``, ``cp``, ``dp``, ``pp``. Megatron builds ``tp``, ``cp``,
  ``dp``, ``pp``, ``tp-pp`` (its "model parallel" group), ``dp-cp``, ``tp-cp``, ``tp-dp-cp`` and ``tp-dp``.
* expert kinds: ``expert-`` followed by a combination of ``tp``, ``ep``, ``dp``, ``pp``, read on the
  expert grid (``expert-tp`` is the expert-tensor-parallel group of size etp, ``expert-dp`` the expert
  data-parallel group of size edp). Megatron builds ``expert-ep``, ``expert-tp``, ``expert-tp-ep``,
  ``expert-tp-ep-pp`` and ``expert-dp``. ``expert-pp`` equals ``pp`` (megatron requires it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

TOKENS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DENSE_GROUP_KINDS = ("tp", "cp", "dp", "pp", "tp-pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-dp")
EXPERT_GROUP_KINDS = ("expert-tp", "expert-ep", "expert-dp", "expert-tp-ep", "expert-tp-ep-pp")
_DENSE_TOKENS = frozenset(("tp", "cp", "dp", "pp"))
_EXPERT_TOKENS = frozenset(("tp", "ep", "dp", "pp"))
_EXPERT_PREFIX = "expert-"


@dataclass(frozen=True)
class RankCoords:
    group_rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    dp_size: int
    is_dp_leader: bool  # the rank whose result stands for its data-parallel replica
    # Position in the expert grid (megatron's expert-model-parallel, expert-tensor-parallel and
    # expert-data-parallel ranks).
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron's layout of ``world`` ranks. ``etp`` defaults to ``tp`` (as in megatron); ``vpp`` is the
    virtual pipeline (interleaved schedule) size, None when not interleaving; ``order`` is megatron's
    rank order, tokens tp, cp, ep, dp, pp, first fastest (tokens of size 1 may be left out)."""

    GROUP_KINDS: ClassVar[tuple[str, ...]] = DENSE_GROUP_KINDS + EXPERT_GROUP_KINDS

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    order: str = DEFAULT_ORDER
    # Set by __post_init__, outside the dataclass fields (not in repr, ==, hash or asdict): _tokens,
    # the full digit order (order's tokens, then the size-1 tokens it left out), and per grid
    # (_dense, _expert) each token's (size, stride) along it.

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        self._check_sizes()
        given = self._parse_order()
        dense = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        exp = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}
        self._check_order_names(given, dense, exp)
        object.__setattr__(self, "order", "-".join(given))
        tokens = tuple(given) + tuple(t for t in TOKENS if t not in given)
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "_dense", _strides(tokens, dense))
        object.__setattr__(self, "_expert", _strides(tokens, exp))
        self._check_grids_agree()

    def _check_sizes(self) -> None:
        """Every size at least 1, and the ranks divisible into the dense and the expert model-parallel groups."""
        for name in ("world", "tp", "pp", "cp", "ep", "etp") + (
            ("vpp",) if self.vpp is not None else ()
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be >= 1, got {v!r}")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise ValueError(
                f"{self.world} ranks cannot be split into tp={self.tp} x cp={self.cp} x pp={self.pp} "
                f"(= {model}) model-parallel groups: the rank count must be a multiple of {model}"
            )
        expert = self.etp * self.ep * self.pp
        if self.world % expert:
            raise ValueError(
                f"{self.world} ranks cannot be split into etp={self.etp} x ep={self.ep} x pp={self.pp} "
                f"(= {expert}) expert-model-parallel groups: the rank count must be a multiple of {expert}"
                + (" (etp defaults to tp)" if self.etp == self.tp else "")
            )
        if self.vpp is not None and self.pp == 1:
            raise ValueError(
                f"vpp={self.vpp} (interleaved pipeline schedule) needs pp > 1, got pp=1"
            )

    def _parse_order(self) -> list[str]:
        """``order``'s tokens, lower-cased, each known and named once."""
        order = self.order.lower() if isinstance(self.order, str) else self.order
        if not isinstance(order, str) or not order:
            raise ValueError(f"order must be a string like {DEFAULT_ORDER!r}, got {self.order!r}")
        given = order.split("-")
        unknown = [t for t in given if t not in TOKENS]
        if unknown:
            raise ValueError(
                f"order {self.order!r}: unknown token(s) {', '.join(map(repr, unknown))}; "
                f"tokens are {', '.join(TOKENS)}"
            )
        if len(set(given)) != len(given):
            raise ValueError(f"order {self.order!r} names a token twice")
        return given

    def _check_order_names(
        self, given: list[str], dense: dict[str, int], exp: dict[str, int]
    ) -> None:
        """``order`` may leave out only the tokens whose size is 1 in both grids."""
        for grid, sizes, names in (
            ("dense", dense, {}),
            ("expert", exp, {"tp": "etp", "dp": "edp"}),
        ):
            for t in TOKENS:
                if t not in given and sizes[t] != 1:
                    name = names.get(t, t)
                    raise ValueError(
                        f"order {self.order!r} leaves out {t!r}, but the {grid} grid has "
                        f"{name}={sizes[t]}: name every token whose size is not 1"
                    )

    def _check_grids_agree(self) -> None:
        """What megatron-core's initialize_model_parallel asserts of the two grids under pp > 1."""
        if self.pp > 1 and not self.order.endswith("pp") and self.edp != self.dp:
            raise ValueError(
                f"order {self.order!r} does not put pp last, so the dense and expert grids need the same "
                f"data-parallel size, but dp={self.dp} (world / (tp x cp x pp)) and edp={self.edp} "
                f"(world / (etp x ep x pp))"
            )
        if self.pp > 1 and self._dense["pp"] != self._expert["pp"]:
            d, e = self._dense["pp"][1], self._expert["pp"][1]
            raise ValueError(
                f"order {self.order!r} gives the dense and expert grids different pipeline groups "
                f"(pipeline stages {d} ranks apart vs {e}): the tokens before pp must span as many ranks "
                f"in both (tp x cp x dp vs etp x ep x edp of those placed before pp)"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense grid."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world // (etp x ep x pp)."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def rank_order(self) -> tuple[str, ...]:
        """All five tokens, fastest first: ``order``'s, then those it left out (of size 1)."""
        return self._tokens

    def coords(self, group_rank: int) -> RankCoords:
        if not 0 <= group_rank < self.world:
            raise IndexError(f"rank {group_rank} outside a group of {self.world}")
        r = group_rank
        d, e = self._dense, self._expert

        def digit(grid: dict[str, tuple[int, int]], t: str) -> int:
            size, stride = grid[t]
            return (r // stride) % size

        tp_rank, cp_rank, pp_rank = digit(d, "tp"), digit(d, "cp"), digit(d, "pp")
        leader = tp_rank == 0 and cp_rank == 0 and pp_rank == self.pp - 1
        return RankCoords(
            group_rank,
            tp_rank,
            cp_rank,
            digit(d, "dp"),
            pp_rank,
            self.dp,
            leader,
            ep_rank=digit(e, "ep"),
            etp_rank=digit(e, "tp"),
            edp_rank=digit(e, "dp"),
        )

    def all_coords(self) -> list[RankCoords]:
        return [self.coords(r) for r in range(self.world)]

    def groups(self, kind: str) -> list[list[int]]:
        """The process groups of ``kind`` (see the module docstring), in megatron's order: groups by
        their lowest rank, each group's ranks by the position megatron gives them in it."""
        grid, mask = self._parse_kind(kind)
        inner, outer = [0], [0]  # offsets of a rank within its group; first rank of each group
        for t in self._tokens:
            size, stride = grid[t]
            if size == 1:
                continue
            if t in mask:
                inner = [k * stride + o for k in range(size) for o in inner]
            else:
                outer = [k * stride + o for k in range(size) for o in outer]
        return [[b + o for o in inner] for b in outer]

    def _parse_kind(self, kind: str) -> tuple[dict[str, tuple[int, int]], frozenset[str]]:
        if not isinstance(kind, str):
            raise ValueError(f"group kind must be a string, got {kind!r}")
        expert = kind.startswith(_EXPERT_PREFIX)
        parts = (kind[len(_EXPERT_PREFIX) :] if expert else kind).split("-")
        allowed = _EXPERT_TOKENS if expert else _DENSE_TOKENS
        bad = [p for p in parts if p not in allowed]
        if bad or len(set(parts)) != len(parts):
            hint = (
                " (the expert-parallel group is 'expert-ep')"
                if not expert and "ep" in parts
                else ""
            )
            raise ValueError(
                f"unknown group kind {kind!r}{hint}: dense kinds join tokens of {', '.join(sorted(_DENSE_TOKENS))}; "
                f"expert kinds are 'expert-' joined with tokens of {', '.join(sorted(_EXPERT_TOKENS))}, "
                f"each token at most once"
            )
        return (self._expert if expert else self._dense), frozenset(parts)


def _strides(tokens: tuple[str, ...], sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    out, stride = {}, 1
    for t in tokens:
        out[t] = (sizes[t], stride)
        stride *= sizes[t]
    return out


def pipeline_stage_layers(num_layers: int, pp: int, vpp: int | None = None) -> list[list[range]]:
    """The decoder layers (0-based) each pipeline stage holds, one range per model chunk (virtual
    stage), as megatron-core assigns them with even splits: chunk v of stage s holds the
    ``(v * pp + s)``-th block of ``num_layers / (pp * vpp)`` layers. The first stage's first chunk also
    holds the embedding, the last stage's last chunk the final norm and the output layer."""
    chunks = vpp or 1
    if num_layers % (pp * chunks):
        raise ValueError(
            f"{num_layers} layers cannot be split evenly into pp={pp} x vpp={chunks} = "
            f"{pp * chunks} pipeline stages"
        )
    per = num_layers // (pp * chunks)
    return [
        [range((v * pp + s) * per, (v * pp + s + 1) * per) for v in range(chunks)]
        for s in range(pp)
    ]
