"""Parallel layout of one role: where each of its ranks sits in the TP x CP x DP x PP grid.

Rank order follows megatron-core's default ("tp-cp-ep-dp-pp"): tensor-parallel peers are
neighbours (so they share a node), pipeline stages are farthest apart. Plain values, no globals:
the controller computes every role's layout without importing megatron or touching a device.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoords:
    group_rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    dp_size: int
    is_dp_leader: bool  # the rank whose result stands for its data-parallel replica


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise ValueError(
                f"{self.world} ranks cannot be split into tp={self.tp} x cp={self.cp} x pp={self.pp} "
                f"(= {model}) model-parallel groups: the rank count must be a multiple of {model}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp x cp = {self.dp * self.cp}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    def coords(self, group_rank: int) -> RankCoords:
        if not 0 <= group_rank < self.world:
            raise IndexError(f"rank {group_rank} outside a group of {self.world}")
        r = group_rank
        tp_rank, r = r % self.tp, r // self.tp
        cp_rank, r = r % self.cp, r // self.cp
        dp_rank, pp_rank = r % self.dp, r // self.dp
        leader = tp_rank == 0 and cp_rank == 0 and pp_rank == self.pp - 1
        return RankCoords(group_rank, tp_rank, cp_rank, dp_rank, pp_rank, self.dp, leader)

    def all_coords(self) -> list[RankCoords]:
        return [self.coords(r) for r in range(self.world)]
