"""FrozenLake as a text environment: gymnasium's ``FrozenLakeEnv`` moves the player, we write the text.

Why gymnasium underneath: its dynamics (the slip model, the hole and goal rules) are the reference every
paper's FrozenLake numbers come from, and ``generate_random_map`` only returns maps with a path from the
start to the goal. What we add is what a language model needs: a new random map per reset seed, a compact
rendering (gymnasium's ANSI text carries colour escapes and a line of the last action), lenient action
parsing, a turn limit that counts invalid text, and an expert.

Observation (a 4x4 map; one row per line, no border; the row of an episode holds every observation, so
it is kept to ``size * (size + 1)`` characters)::

    P..H
    .H..
    ...H
    H..G

``P`` the player, ``.`` frozen, ``H`` hole, ``G`` goal. Actions: ``left``, ``down``, ``right``, ``up``
(read by ``rollhpc.envs.grid.parse_direction``: any case, the first direction word, or l/d/r/u alone).
Reward 1 on reaching the goal (terminated, success), 0 otherwise; a hole terminates with success False;
text that is no direction gets 0, the observation "Invalid action: ..." and ``metrics.invalid_action``
1, and counts as a turn. ``max_turns`` turns truncate the episode.

Seeds: reset(seed) draws the map with ``generate_random_map(size, p, seed)`` and seeds the slip RNG with
the same seed, so an episode is a function of the seed and the actions. Seeds must be >= 0 (gymnasium's).

Expert: on a non-slippery map the first move of a breadth-first shortest path to the goal (always
exists: moves between frozen cells are reversible, so the goal stays reachable from wherever the player
can be). On a slippery map the move that maximises the probability of reaching the goal within the turns
left (finite-horizon value iteration over gymnasium's own transition table ``P``), ties broken towards
the shortest-path move. Measured over seeds 0..199 (default options otherwise): the expert succeeds on every
non-slippery 4x4 map (random moves: 0.025); on slippery 4x4 maps (success_rate 1/3, 16 turns) it succeeds
0.295 of the time (random: 0.025), on slippery 8x8 maps (64 turns, seeds 0..99) 0.34 (random: 0). Slippery
maps are hard for everyone: a slip lands in a hole whatever the policy meant.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

from rollhpc.envs.base import check_episode_running
from rollhpc.envs.grid import DIRECTIONS, OFFSETS, invalid_text, parse_direction, reset_info

__all__ = ["FrozenLake", "ENV"]

INSTRUCTION = "Walk P to G without stepping into H. Answer left, down, right or up."


class FrozenLake:
    """Options: ``size`` (map side, default 4), ``p`` (probability a tile is frozen, default 0.8),
    ``is_slippery`` (default False), ``success_rate`` (probability a slippery move goes where it was meant,
    gymnasium's 1/3), ``max_turns`` (default size * size: every shortest path fits)."""

    ACTIONS = DIRECTIONS  # what a random policy picks from

    def __init__(
        self,
        size: int = 4,
        p: float = 0.8,
        is_slippery: bool = False,
        success_rate: float = 1.0 / 3.0,
        max_turns: int | None = None,
    ) -> None:
        if not isinstance(size, int) or size < 2:
            raise ValueError(f"size must be an integer >= 2, got {size!r}")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"p (probability of a frozen tile) must be in (0, 1], got {p!r}")
        if not 0.0 < success_rate <= 1.0:
            raise ValueError(f"success_rate must be in (0, 1], got {success_rate!r}")
        self.size, self.p, self.is_slippery, self.success_rate = (
            size,
            float(p),
            bool(is_slippery),
            float(success_rate),
        )
        self.max_turns = size * size if max_turns is None else int(max_turns)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns!r}")
        self._map: tuple[str, ...] = ()
        self._gym: FrozenLakeEnv | None = None
        self._turn = 0
        self._done = True
        # [turns left, state, action] success probabilities (slippery expert)
        self._values: np.ndarray | None = None

    # ------------------------------------------------------------------ the TextEnv protocol
    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        seed = int(seed)
        if seed < 0:
            raise ValueError(f"FrozenLake seeds must be >= 0 (gymnasium's rule), got {seed}")
        self._map = tuple(generate_random_map(size=self.size, p=self.p, seed=seed))
        self._gym = FrozenLakeEnv(
            desc=list(self._map), is_slippery=self.is_slippery, success_rate=self.success_rate
        )
        self._gym.reset(seed=seed)
        self._turn, self._done, self._values = 0, False, None
        return self._render(), reset_info(INSTRUCTION, self._state_key())

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_episode_running(self._done or self._gym is None)
        self._turn += 1
        direction = parse_direction(action)
        reward, terminated = 0.0, False
        if direction is None:
            observation = invalid_text()
        else:
            _, r, terminated, _, _ = self._gym.step(DIRECTIONS.index(direction))
            reward = float(r)
            observation = self._render()
        tile = self._tile()
        success = tile == "G"
        if terminated:
            observation += "\nYou reached the goal." if success else "\nYou fell into a hole."
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        info = {
            "state_key": self._state_key(),
            "success": success,
            "metrics": {"invalid_action": float(direction is None)},
        }
        return observation, reward, bool(terminated), truncated, info

    def close(self) -> None:
        if self._gym is not None:
            self._gym.close()
            self._gym = None

    # ------------------------------------------------------------------ the expert
    def expert_action(self) -> str:
        """The shortest-path move (non-slippery), or the move most likely to reach the goal in the turns left."""
        shortest = self._shortest_path_move()
        if not self.is_slippery:
            return shortest
        q = self._success_table()[max(self.max_turns - self._turn, 0), self._position_index()]
        best = q.max()
        ties = [DIRECTIONS[a] for a in range(4) if q[a] >= best - 1e-12]
        return shortest if shortest in ties else ties[0]

    def _shortest_path_move(self) -> str:
        start = self._position()
        first: dict[tuple[int, int], str | None] = {start: None}
        queue = deque([start])
        while queue:
            r, c = queue.popleft()
            if self._map[r][c] == "G":
                return first[(r, c)] or DIRECTIONS[0]
            if self._map[r][c] == "H":
                continue
            for d in DIRECTIONS:
                nxt = (r + OFFSETS[d][0], c + OFFSETS[d][1])
                if 0 <= nxt[0] < self.size and 0 <= nxt[1] < self.size and nxt not in first:
                    first[nxt] = first[(r, c)] or d
                    queue.append(nxt)
        return DIRECTIONS[0]  # no path (only from a hole or the goal, after the episode ended)

    def _success_table(self) -> np.ndarray:
        """Q[k, s, a]: the probability of reaching the goal within k turns, moving ``a`` from ``s`` and then
        optimally; from gymnasium's transition table, so it follows gymnasium's slip model exactly."""
        if self._values is None:
            assert self._gym is not None
            n = self.size * self.size
            move = np.zeros((n, 4, n))
            for s in range(n):
                for a in range(4):
                    for prob, nxt, _, _ in self._gym.P[s][a]:
                        move[s, a, nxt] += prob
            tiles = "".join(self._map)
            goal = np.array([t == "G" for t in tiles], dtype=float)
            alive = np.array([t not in "GH" for t in tiles], dtype=float)
            q = np.zeros((self.max_turns + 1, n, 4))
            value = np.zeros(n)
            for k in range(1, self.max_turns + 1):
                q[k] = move @ (goal + alive * value)
                value = q[k].max(axis=1) * alive
            self._values = q
        return self._values

    # ------------------------------------------------------------------ text and state
    def _position_index(self) -> int:
        assert self._gym is not None
        return int(self._gym.s)

    def _position(self) -> tuple[int, int]:
        return divmod(self._position_index(), self.size)

    def _tile(self) -> str:
        r, c = self._position()
        return self._map[r][c]

    def _render(self) -> str:
        r, c = self._position()
        rows = [row.replace("S", ".").replace("F", ".") for row in self._map]
        rows[r] = rows[r][:c] + "P" + rows[r][c + 1 :]
        return "\n".join(rows)

    def _state_key(self) -> tuple[str, int]:
        return "/".join(self._map), self._position_index()


ENV = FrozenLake
