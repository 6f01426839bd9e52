"""Sokoban rooms, the breadth-first solver and the level generator (pure logic; the environment is sokoban.py).

Why generate by playing backwards: a level made by pulling boxes off their targets from a solved room is
solvable by construction (each pull is the inverse of a legal push), so no level is ever thrown away as
impossible, and the generator needs the solver only to measure the level: levels solved from the start,
solved in fewer than ``min_moves`` moves (too easy to teach anything) or needing more moves than the
episode allows are drawn again.

Cells are numbered ``row * width + column`` over the room's interior; the border wall is implicit (a move
off the grid is a move into a wall), which keeps the rendering short.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from rollhpc.envs.grid import DIRECTIONS, OFFSETS
from rollhpc.tasks.arithmetic import randint

__all__ = ["Room", "Level", "solve", "dead_end", "generate"]

BLOCKED = -1
State = tuple[int, frozenset[int]]  # (player cell, box cells)


@dataclass(frozen=True)
class Room:
    """The static part of a level: its size, interior walls and targets, and each cell's neighbours."""

    height: int
    width: int
    walls: frozenset[int]
    targets: frozenset[int]
    neighbours: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    dead: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = []
        for cell in range(self.height * self.width):
            r, c = divmod(cell, self.width)
            row = []
            for d in DIRECTIONS:
                nr, nc = r + OFFSETS[d][0], c + OFFSETS[d][1]
                inside = 0 <= nr < self.height and 0 <= nc < self.width
                row.append(
                    nr * self.width + nc
                    if inside and nr * self.width + nc not in self.walls
                    else BLOCKED
                )
            table.append(tuple(row))
        object.__setattr__(self, "neighbours", tuple(table))
        object.__setattr__(self, "dead", frozenset(self._corner_cells()))

    def _corner_cells(self) -> list[int]:
        """Floor cells that are not targets and have a wall across one horizontal and one vertical side: a box
        pushed there can never leave (the classic simple deadlock), so the solver never pushes one there."""
        left, down, right, up = range(4)
        dead = []
        for cell, n in enumerate(self.neighbours):
            if cell in self.walls or cell in self.targets:
                continue
            if (n[left] == BLOCKED or n[right] == BLOCKED) and (
                n[up] == BLOCKED or n[down] == BLOCKED
            ):
                dead.append(cell)
        return dead

    def floor(self) -> list[int]:
        return [c for c in range(self.height * self.width) if c not in self.walls]

    def connected(self) -> bool:
        """Whether every floor cell can be reached from every other (walls must not split the room)."""
        cells = self.floor()
        seen, queue = {cells[0]}, deque([cells[0]])
        while queue:
            for nxt in self.neighbours[queue.popleft()]:
                if nxt != BLOCKED and nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        return len(seen) == len(cells)


@dataclass(frozen=True)
class Level:
    room: Room
    player: int
    boxes: frozenset[int]
    plan: tuple[str, ...]  # a shortest solution (moves), from the solver


def move(
    room: Room, player: int, boxes: frozenset[int], direction: int
) -> tuple[int, frozenset[int], int] | None:
    """One move: (player, boxes, pushed box's destination or BLOCKED), or None when the move is blocked."""
    nxt = room.neighbours[player][direction]
    if nxt == BLOCKED:
        return None
    if nxt not in boxes:
        return nxt, boxes, BLOCKED
    beyond = room.neighbours[nxt][direction]
    if beyond == BLOCKED or beyond in boxes:
        return None
    return nxt, (boxes - {nxt}) | {beyond}, beyond


def solve(
    room: Room, player: int, boxes: frozenset[int], max_states: int = 200_000
) -> list[str] | None:
    """A shortest move sequence that puts every box on a target; [] when solved, None when there is none or
    the search passed ``max_states`` states. Breadth-first over (player, boxes), so shortest in moves (turns),
    not pushes; pushes into dead corners are pruned (they never lead to a solution)."""
    return _search(room, player, boxes, max_states)[0]


def dead_end(room: Room, player: int, boxes: frozenset[int], max_states: int = 200_000) -> bool:
    """True only when no move sequence from here solves the room, proved by searching every reachable state;
    a search cut at ``max_states`` proves nothing and says False (a live room is never called dead)."""
    plan, exhausted = _search(room, player, boxes, max_states)
    return plan is None and exhausted


def _search(
    room: Room, player: int, boxes: frozenset[int], max_states: int
) -> tuple[list[str] | None, bool]:
    """(a shortest plan or None, whether the reachable states were all searched)."""
    if boxes <= room.targets:
        return [], False
    start: State = (player, boxes)
    parent: dict[State, tuple[State, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for d in range(4):
            moved = move(room, state[0], state[1], d)
            if moved is None or moved[2] in room.dead:
                continue
            nxt: State = (moved[0], moved[1])
            if nxt in parent:
                continue
            parent[nxt] = (state, d)
            if moved[1] <= room.targets:
                return _path(parent, nxt), False
            if len(parent) > max_states:
                return None, False
            queue.append(nxt)
    return None, True


def _path(parent: dict[State, tuple[State, int] | None], end: State) -> list[str]:
    moves = []
    link = parent[end]
    while link is not None:
        state, d = link
        moves.append(DIRECTIONS[d])
        link = parent[state]
    return moves[::-1]


def _random_room(rng: random.Random, size: int, n_boxes: int) -> Room:
    """A size x size interior with up to size - 2 wall cells that leave the floor connected, and n_boxes targets."""
    walls: set[int] = set()
    for _ in range(randint(rng, 0, size - 2)):
        cell = randint(rng, 0, size * size - 1)
        if (
            cell not in walls
            and Room(size, size, frozenset(walls | {cell}), frozenset()).connected()
        ):
            walls.add(cell)
    floor = [c for c in range(size * size) if c not in walls]
    targets = {floor.pop(randint(rng, 0, len(floor) - 1)) for _ in range(n_boxes)}
    return Room(size, size, frozenset(walls), frozenset(targets))


def generate(
    seed: int, size: int, n_boxes: int, min_moves: int, max_moves: int, attempts: int = 1000
) -> Level:
    """A level for ``seed`` (deterministic: only ``random.Random(seed).random()`` is used, the stream Python keeps
    stable across versions), solvable in ``min_moves`` to ``max_moves`` moves."""
    rng = random.Random(seed)
    for _ in range(attempts):
        room = _random_room(rng, size, n_boxes)
        floor = [c for c in room.floor() if c not in room.targets]
        if not floor:
            continue
        boxes, player = set(room.targets), floor[randint(rng, 0, len(floor) - 1)]
        # the backward walk: moves and pulls
        for _ in range(randint(rng, 2 * size, 6 * size) * n_boxes):
            d = randint(rng, 0, 3)
            nxt, behind = room.neighbours[player][d], room.neighbours[player][(d + 2) % 4]
            if nxt == BLOCKED or nxt in boxes:
                continue
            if behind in boxes and rng.random() < 0.75:  # pull: the box behind follows the player
                boxes.remove(behind)
                boxes.add(player)
            player = nxt
        frozen = frozenset(boxes)
        if frozen <= room.targets:
            continue
        plan = solve(room, player, frozen)
        if plan is not None and min_moves <= len(plan) <= max_moves:
            return Level(room, player, frozen, tuple(plan))
    raise ValueError(
        f"no Sokoban level of size {size} with {n_boxes} boxes solvable in {min_moves}..{max_moves} "
        f"moves after {attempts} attempts for seed {seed}: allow more moves (max_turns)"
    )
