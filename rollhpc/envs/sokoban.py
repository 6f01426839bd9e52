"""Sokoban as a text environment: push every box onto a target in a small room (our own implementation).

Why our own and not a gym package: the levels must be small (a tiny policy reads the whole room every
turn within a ~256-token context), generated per seed without downloads, and come with a solver for the
expert; sokoban_levels.py does that in ~150 lines of pure Python.

Observation (a 5x5 interior; the surrounding wall is not drawn, a move off the grid is a move into it)::

    __#__
    _B___
    __P._
    _____
    _____

``_`` floor, ``#`` wall, ``.`` target, ``B`` box, ``*`` box on a target, ``P`` player, ``+`` player on a target.
Actions: ``left``, ``down``, ``right``, ``up`` (parsed leniently by ``rollhpc.envs.grid.parse_direction``).
Walking into a wall or a blocked box leaves the room as it was and still costs the turn.

Reward (gym-sokoban's scheme, so returns compare with the Sokoban numbers in the literature): -0.1 per
turn, +1 for a box pushed onto a target, -1 for one pushed off, +10 when every box is on a target
(terminated, success True). Text that is no direction costs the turn's -0.1, gets the observation
"Invalid action: ..." and ``metrics.invalid_action`` 1, and ``format_penalty`` (default 0; RAGEN's
Sokoban takes 1) is subtracted from its reward: without it, text that is no move costs no more than a move
that goes nowhere, and RL can drift a tiny policy into garbage. ``strict_format`` (default False) reads
only a turn that is one direction word alone, anything more is invalid (``parse_direction(strict=True)``:
leniently read, the words after the move go unchecked and RL let a tiny policy ramble on past it). A move
into a wall or a blocked box counts ``metrics.blocked_move`` 1. ``max_turns`` turns truncate the episode.

Dead ends (``end_on_dead_end``, off by default as in gym-sokoban): a push after which no sequence of moves
solves the room (proved by the solver searching every reachable state) ends the episode at once
(terminated, success False, ``metrics.dead_end`` 1), charged the -0.1 of each turn it had left. The
return is then what playing the rest out would have given, so returns compare with runs that play on,
and a quick dead end is never cheaper than a long walk; what is saved is the turns themselves (a third of
an untrained policy's episodes walk into one, and spend the rest of their turns there).

Levels: ``reset(seed)`` generates one by backward play (sokoban_levels.generate), solvable in at least
``min_moves`` and at most ``max_turns`` moves, so an optimal policy always succeeds. The expert follows a
breadth-first shortest plan, cached per episode and re-planned when the policy left it; from a dead end
(a box stuck against a wall) it has no plan and says "up".
"""

from __future__ import annotations

from typing import Any

from rollhpc.envs.base import check_episode_running
from rollhpc.envs.grid import DIRECTIONS, invalid_text, parse_direction, reset_info
from rollhpc.envs.sokoban_levels import BLOCKED, Level, dead_end, generate, move, solve

__all__ = ["Sokoban", "ENV", "STEP_REWARD", "BOX_ON_REWARD", "BOX_OFF_REWARD", "SOLVED_REWARD"]

STEP_REWARD = -0.1
BOX_ON_REWARD = 1.0
BOX_OFF_REWARD = -1.0
SOLVED_REWARD = 10.0
INSTRUCTION = "Push every B onto a . target. Answer left, down, right or up."


class Sokoban:
    """Options: ``size`` (interior side, 4 to 8, default 5), ``boxes`` (1 to 3, default 1), ``max_turns``
    (default 20; also the longest solution a level may need), ``min_moves`` (the shortest solution a level
    may have, default 3), ``end_on_dead_end`` (default False: end an episode whose room can no longer be
    solved, charged its remaining turns), ``format_penalty`` (default 0: subtracted from the reward of a
    turn whose text is no move), ``strict_format`` (default False: the first direction word anywhere in a turn's
    text is its move; True: the text must be one direction word alone)."""

    ACTIONS = DIRECTIONS  # what a random policy picks from

    def __init__(
        self,
        size: int = 5,
        boxes: int = 1,
        max_turns: int = 20,
        min_moves: int = 3,
        end_on_dead_end: bool = False,
        format_penalty: float = 0.0,
        strict_format: bool = False,
    ) -> None:
        if not isinstance(size, int) or not 4 <= size <= 8:
            raise ValueError(
                f"size (the room's interior side) must be an integer in 4..8, got {size!r}"
            )
        if not isinstance(boxes, int) or not 1 <= boxes <= 3:
            raise ValueError(f"boxes must be 1, 2 or 3, got {boxes!r}")
        if not isinstance(min_moves, int) or min_moves < 1:
            raise ValueError(f"min_moves must be an integer >= 1, got {min_moves!r}")
        if not isinstance(max_turns, int) or max_turns < min_moves:
            raise ValueError(
                f"max_turns must be an integer >= min_moves ({min_moves}), got {max_turns!r}"
            )
        if not isinstance(end_on_dead_end, bool):
            raise ValueError(f"end_on_dead_end must be true or false, got {end_on_dead_end!r}")
        if not isinstance(format_penalty, (int, float)) or format_penalty < 0:
            raise ValueError(
                f"format_penalty must be a number >= 0 (subtracted from an invalid turn's reward), "
                f"got {format_penalty!r}"
            )
        if not isinstance(strict_format, bool):
            raise ValueError(f"strict_format must be true or false, got {strict_format!r}")
        self.format_penalty = float(format_penalty)
        self.strict_format = strict_format
        self.size, self.n_boxes, self.max_turns, self.min_moves = size, boxes, max_turns, min_moves
        self.end_on_dead_end = end_on_dead_end
        self._level: Level | None = None
        self._player = 0
        self._boxes: frozenset[int] = frozenset()
        self._turn = 0
        self._done = True
        self._plan: dict[tuple[int, frozenset[int]], str] = {}  # state -> the expert's move from it

    # ------------------------------------------------------------------ the TextEnv protocol
    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._level = generate(int(seed), self.size, self.n_boxes, self.min_moves, self.max_turns)
        self._player, self._boxes = self._level.player, self._level.boxes
        self._turn, self._done = 0, False
        self._plan = self._plan_states(list(self._level.plan))
        return self._render(), reset_info(INSTRUCTION, self._state_key())

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_episode_running(self._done or self._level is None)
        self._turn += 1
        direction = parse_direction(action, strict=self.strict_format)
        reward = STEP_REWARD
        blocked = pushed = False
        if direction is None:
            observation = invalid_text()
            reward -= self.format_penalty
        else:
            moved = move(self._level.room, self._player, self._boxes, DIRECTIONS.index(direction))
            blocked = moved is None
            if moved is not None:
                targets = self._level.room.targets
                before = len(self._boxes & targets)
                self._player, self._boxes, landed = moved
                pushed = landed != BLOCKED
                after = len(self._boxes & targets)
                reward += BOX_ON_REWARD * max(after - before, 0) + BOX_OFF_REWARD * max(
                    before - after, 0
                )
            observation = self._render()
        solved = self._boxes <= self._level.room.targets
        if solved:
            reward += SOLVED_REWARD
            observation += "\nSolved."
        # only a push can make a room unsolvable: a walk never needs the solver
        dead = (
            self.end_on_dead_end
            and pushed
            and not solved
            and self._turn < self.max_turns
            and dead_end(self._level.room, self._player, self._boxes)
        )
        if dead:
            reward += STEP_REWARD * (self.max_turns - self._turn)
            observation += "\nDead end: no box can reach a target any more."
        truncated = not solved and not dead and self._turn >= self.max_turns
        self._done = solved or dead or truncated
        info = {
            "state_key": self._state_key(),
            "success": solved,
            "metrics": {
                "invalid_action": float(direction is None),
                "blocked_move": float(blocked),
                "dead_end": float(dead),
            },
        }
        return observation, reward, solved or dead, truncated, info

    def close(self) -> None:
        self._level = None

    # ------------------------------------------------------------------ the expert
    def expert_action(self) -> str:
        """The next move of a shortest solution from the current state (re-planned if the policy left the plan)."""
        assert self._level is not None, "call reset(seed) first"
        state = (self._player, self._boxes)
        if state not in self._plan:
            self._plan = self._plan_states(solve(self._level.room, self._player, self._boxes) or [])
        return self._plan.get(state, DIRECTIONS[3])

    def _plan_states(self, plan: list[str]) -> dict[tuple[int, frozenset[int]], str]:
        """Each state along ``plan`` (from the current one) mapped to the move the plan makes there."""
        assert self._level is not None
        player, boxes, out = self._player, self._boxes, {}
        for name in plan:
            out[(player, boxes)] = name
            moved = move(self._level.room, player, boxes, DIRECTIONS.index(name))
            assert moved is not None, "the solver's plan makes a blocked move"
            player, boxes, _ = moved
        return out

    # ------------------------------------------------------------------ text and state
    def _render(self) -> str:
        assert self._level is not None
        room = self._level.room
        rows = []
        for r in range(room.height):
            row = []
            for c in range(room.width):
                cell = r * room.width + c
                on_target = cell in room.targets
                if cell in room.walls:
                    row.append("#")
                elif cell == self._player:
                    row.append("+" if on_target else "P")
                elif cell in self._boxes:
                    row.append("*" if on_target else "B")
                else:
                    row.append("." if on_target else "_")
            rows.append("".join(row))
        return "\n".join(rows)

    def _state_key(self) -> tuple[int, int, frozenset[int], frozenset[int], int, frozenset[int]]:
        assert self._level is not None
        room = self._level.room
        return room.height, room.width, room.walls, room.targets, self._player, self._boxes


ENV = Sokoban
