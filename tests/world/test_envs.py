"""Text environments (rollhpc.envs): deterministic resets, experts that solve, random play that does not,
invalid text handled, the tool environment's real sandboxed calls, the episode runner and `rollhpc env`."""

from __future__ import annotations

import pytest

from rollhpc import cli
from rollhpc.envs import available_envs, env_class, make_env
from rollhpc.envs.base import HELDOUT_SEED_BASE
from rollhpc.envs.episodes import run_episode, run_episodes
from rollhpc.envs.frozenlake import FrozenLake
from rollhpc.envs.grid import DIRECTIONS, parse_direction
from rollhpc.envs.policies import ExpertPolicy, ModelPolicy
from rollhpc.envs.sokoban import SOLVED_REWARD, STEP_REWARD, Sokoban
from rollhpc.envs.sokoban_levels import BLOCKED, dead_end, generate, move, solve
from rollhpc.rollout.turns import PlainTextTurns
from rollhpc.sandbox import SandboxUnavailable
from rollhpc.tasks import countdown
from tests.support.processes import REPO, rollhpc


# ---------------------------------------------------------------------------------------------- registry, parsing
def test_registry_lists_the_shipped_envs_and_names_bad_ones():
    assert {"frozenlake", "sokoban", "python_tool"} <= set(available_envs())
    assert env_class("rollhpc.envs.sokoban:Sokoban") is Sokoban
    with pytest.raises(ValueError, match="unknown environment 'nope'; shipped: .*frozenlake"):
        env_class("nope")
    with pytest.raises(ValueError, match="does not take options"):
        make_env("frozenlake", {"sise": 4})
    with pytest.raises(ValueError, match="size .* must be an integer in 4..8"):
        make_env("sokoban", {"size": 20})


@pytest.mark.parametrize(
    "text, direction",
    [
        ("left", "left"),
        ("Go LEFT.", "left"),
        (" up", "up"),
        ("u", "up"),
        ("D.", "down"),
        ("right, then up", "right"),
        ("leftover", None),
        ("jump", None),
        ("", None),
        ("lr", None),
    ],
)
def test_directions_are_read_leniently_but_not_guessed(text, direction):
    assert parse_direction(text) == direction


@pytest.mark.parametrize(
    "text, direction",
    [
        ("left", "left"),
        (" Up.", "up"),
        ("down\n", "down"),
        (" down right up left", None),
        ("Go LEFT.", None),
        ("u", None),
        ("right, then up", None),
    ],
)
def test_strict_directions_are_one_word_alone(text, direction):
    assert parse_direction(text, strict=True) == direction


# ---------------------------------------------------------------------------------------------- FrozenLake
def test_frozenlake_reset_is_a_function_of_the_seed():
    env = FrozenLake(size=5)
    first = [env.reset(seed) for seed in range(6)]
    again = [env.reset(seed) for seed in range(6)]
    assert [(o, i["state_key"]) for o, i in first] == [(o, i["state_key"]) for o, i in again]
    assert len({o for o, _ in first}) > 1  # a new map per seed
    observation, info = first[0]
    assert (
        observation.splitlines()[0][0] == "P"
        and observation.count("G") == 1
        and len(observation) == 5 * 6 - 1
    )
    assert "left" in info["instruction"] and "\n" not in info["instruction"]
    hash(info["state_key"])
    # the pipeline's held-out seeds
    assert env.reset(HELDOUT_SEED_BASE + 3) == env.reset(HELDOUT_SEED_BASE + 3)
    with pytest.raises(ValueError, match=">= 0"):
        env.reset(-1)


def test_frozenlake_expert_always_solves_and_random_play_rarely_does():
    expert = run_episodes("frozenlake", {}, "expert", episodes=20)
    random = run_episodes("frozenlake", {}, "random", episodes=20)
    assert expert.success_rate == 1.0 and expert.mean_return == 1.0
    assert expert.metrics["invalid_action"] == 0
    assert random.success_rate < 0.5
    six = run_episodes("frozenlake", {"size": 6, "p": 0.7}, "expert", episodes=10)
    assert six.success_rate == 1.0


def test_frozenlake_slippery_expert_beats_random():
    """4x4 slippery maps (gymnasium's success_rate 1/3, 16 turns), seeds 0..59: the expert (highest success
    probability in the turns left) succeeds 0.283 of the time, uniform random moves 0.033."""
    options = {"is_slippery": True}
    expert = run_episodes("frozenlake", options, "expert", episodes=60)
    random = run_episodes("frozenlake", options, "random", episodes=60)
    print(f"slippery 4x4: expert {expert.success_rate:.3f}, random {random.success_rate:.3f}")
    assert expert.success_rate >= random.success_rate + 0.2
    assert (
        run_episodes("frozenlake", options, "expert", episodes=60).success_rate
        == expert.success_rate
    )


def test_frozenlake_invalid_text_costs_a_turn_and_holes_end_the_episode():
    env = FrozenLake(max_turns=3)
    observation, _ = env.reset(0)
    before = env.reset(0)[1]["state_key"]
    for turn in range(3):
        text, reward, terminated, truncated, info = env.step("jump!")
        assert text.startswith("Invalid action") and reward == 0.0 and not terminated
        assert info["metrics"]["invalid_action"] == 1.0 and info["state_key"] == before
        assert truncated == (turn == 2) and info["success"] is False
    with pytest.raises(RuntimeError, match="reset"):
        env.step("left")

    env = FrozenLake(p=0.5)
    for seed in range(200):  # a map with a hole right of the start
        env.reset(seed)
        if env._map[0][1] == "H":
            break
    text, reward, terminated, truncated, info = env.step("right")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert "hole" in text and info["metrics"]["invalid_action"] == 0.0


# ---------------------------------------------------------------------------------------------- Sokoban
def test_sokoban_levels_are_seeded_solvable_and_not_trivial():
    for seed in range(20):
        level = generate(seed, size=5, n_boxes=1, min_moves=3, max_moves=20)
        assert level == generate(seed, size=5, n_boxes=1, min_moves=3, max_moves=20)
        assert not level.boxes <= level.room.targets and 3 <= len(level.plan) <= 20
        assert level.room.connected() and level.player not in level.boxes | level.room.walls
        assert solve(level.room, level.player, level.boxes) == list(level.plan)
    two = generate(3, size=6, n_boxes=2, min_moves=3, max_moves=30)
    assert len(two.boxes) == 2 and len(two.room.targets) == 2
    assert two.room.neighbours[0][0] == BLOCKED  # the border is a wall


def test_sokoban_rendering_and_determinism():
    env = Sokoban()
    observation, info = env.reset(4)
    assert env.reset(4) == (observation, info)
    rows = observation.splitlines()
    assert len(rows) == 5 and all(len(r) == 5 for r in rows)
    assert (
        set(observation) <= set("_#.B*P+\n")
        and observation.count("P") + observation.count("+") == 1
    )
    assert observation.count("B") + observation.count("*") == 1 and "B" in observation


def test_sokoban_expert_solves_with_gym_sokoban_rewards_and_random_does_not():
    expert = run_episodes("sokoban", {}, "expert", episodes=20)
    assert expert.success_rate == 1.0 and expert.metrics["invalid_action"] == 0
    for t in expert.played:  # -0.1 a turn, +1 onto a target, +10 solved (1 box)
        assert t.episode_return == pytest.approx(len(t.turns) * STEP_REWARD + 1.0 + SOLVED_REWARD)
    random = run_episodes("sokoban", {}, "random", episodes=20)
    assert random.success_rate < 0.5
    two = run_episodes("sokoban", {"size": 6, "boxes": 2, "max_turns": 30}, "expert", episodes=5)
    assert two.success_rate == 1.0


def test_sokoban_expert_replans_after_a_detour_and_invalid_text_costs_a_turn():
    env, detours = Sokoban(max_turns=40), 0
    for seed in range(10):
        env.reset(seed)
        text, reward, terminated, truncated, info = env.step("north-east")
        assert text.startswith("Invalid action") and reward == pytest.approx(STEP_REWARD)
        assert info["metrics"]["invalid_action"] == 1.0 and not (terminated or truncated)
        planned = env.expert_action()
        for d, name in enumerate(DIRECTIONS):  # leave the plan with a move that pushes no box
            moved = move(env._level.room, env._player, env._boxes, d)
            if name != planned and moved is not None and moved[1] == env._boxes:
                env.step(name)
                detours += 1
                break
        done = False
        while not done:
            _, _, terminated, truncated, info = env.step(env.expert_action())
            done = terminated or truncated
        assert info["success"], seed
    assert detours >= 5


def walk_to_a_fatal_push(room, player, boxes) -> list[str] | None:
    """Moves that walk (no push) to a spot and then push the box where it can never reach a target."""
    seen, queue = {player: []}, [player]
    for cell in queue:
        for d, name in enumerate(DIRECTIONS):
            moved = move(room, cell, boxes, d)
            if moved is None:
                continue
            if moved[2] != BLOCKED:
                if dead_end(room, moved[0], moved[1]):
                    return seen[cell] + [name]
            elif moved[0] not in seen:
                seen[moved[0]] = seen[cell] + [name]
                queue.append(moved[0])
    return None


def test_sokoban_dead_end_ends_the_episode_charged_its_remaining_turns():
    """A push that leaves the room unsolvable ends the episode (end_on_dead_end) with the return playing on
    would have given; a blocked move is reported; the option is off by default (gym-sokoban's rules)."""
    env, found = Sokoban(end_on_dead_end=True), 0
    for seed in range(10):
        env.reset(seed)
        path = walk_to_a_fatal_push(env._level.room, env._player, env._boxes)
        if path is None:
            continue
        found += 1
        for name in path[:-1]:  # walks only: the room stays solvable
            *_, info = env.step(name)
            assert info["metrics"]["dead_end"] == 0.0
        text, reward, terminated, truncated, info = env.step(path[-1])
        assert (
            terminated
            and not truncated
            and not info["success"]
            and info["metrics"]["dead_end"] == 1.0
        )
        assert reward == pytest.approx((env.max_turns - len(path) + 1) * STEP_REWARD)
        assert text.endswith("no box can reach a target any more.")
        plain = Sokoban()  # the default plays on
        plain.reset(seed)
        for name in path:
            _, _, terminated, truncated, info = plain.step(name)
        assert not (terminated or truncated) and info["metrics"]["dead_end"] == 0.0
    assert found >= 3
    blocked = [
        (seed, name)
        for seed in range(10)
        for name in DIRECTIONS
        if env.reset(seed)
        and move(env._level.room, env._player, env._boxes, DIRECTIONS.index(name)) is None
    ]
    assert blocked  # a move from the start into the border or a wall
    for seed, name in blocked[:3]:
        env.reset(seed)
        before = env._state_key()
        _, reward, terminated, _, info = env.step(name)
        assert (
            info["metrics"]["blocked_move"] == 1.0 and env._state_key() == before and not terminated
        )
    with pytest.raises(ValueError, match="end_on_dead_end"):
        Sokoban(end_on_dead_end="yes")
    # text that is no move costs more than a move that goes nowhere
    strict = Sokoban(format_penalty=1.0)
    strict.reset(0)
    _, reward, *_ = strict.step("jump")
    assert reward == pytest.approx(STEP_REWARD - 1.0)
    with pytest.raises(ValueError, match="format_penalty"):
        Sokoban(format_penalty=-1)
    # a move followed by more words is invalid
    one_word = Sokoban(format_penalty=1.0, strict_format=True)
    one_word.reset(0)
    _, reward, _, _, info = one_word.step(" down right up left")
    assert reward == pytest.approx(STEP_REWARD - 1.0) and info["metrics"]["invalid_action"] == 1.0
    with pytest.raises(ValueError, match="strict_format"):
        Sokoban(strict_format=1)


# ---------------------------------------------------------------------------------------------- tool use
@pytest.fixture(scope="module")
def sandbox_here() -> None:
    from rollhpc.envs.python_tool import PythonTool

    try:
        PythonTool().close()
    except SandboxUnavailable as e:
        pytest.skip(
            f"the tool environment runs code only in a sandbox, and none can be made here: {e}"
        )


def test_tool_env_runs_real_sandboxed_code_and_scores_with_the_task(sandbox_here):
    env = make_env(
        "python_tool", {"task": "arithmetic", "task_options": {"digits": 3, "ops": ["*"]}}
    )
    observation, info = env.reset(5)
    assert observation == env.example.prompt and "python:" in info["instruction"]
    assert env.reset(5)[0] == observation and env.reset(6)[0] != observation

    text, reward, terminated, truncated, info = env.step(
        f"python: {env.example.a} * {env.example.b}"
    )
    assert text == env.example.answer and info["use_tool"] and (reward, terminated) == (0.0, False)
    text, _, _, _, info = env.step("Python: print(sum(range(10)))\nx = 1/0")
    assert text == "ZeroDivisionError: division by zero" and info["metrics"]["tool_error"] == 1.0
    text, reward, terminated, truncated, info = env.step("answer: " + env.example.answer)
    assert (reward, terminated, info["success"], info["use_tool"]) == (1.0, True, True, False)
    assert info["metrics"]["tool_calls"] == 2.0

    env.reset(5)
    assert env.step("the answer is 7")[0].startswith("Invalid action")
    _, reward, terminated, _, info = env.step("answer: 7")
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    env.close()


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_tool_env_expert_solves_and_random_does_not(sandbox_here, task):
    expert = run_episodes("python_tool", {"task": task}, "expert", episodes=4)
    assert (
        expert.success_rate == 1.0
        and expert.mean_turns == 2.0
        and expert.metrics["tool_calls"] == 1.0
    )
    random = run_episodes("python_tool", {"task": task, "max_turns": 2}, "random", episodes=4)
    assert random.success_rate < expert.success_rate


def test_countdown_search_finds_answers_the_verifier_accepts():
    from rollhpc.envs.python_tool import solve_countdown

    for ex in countdown.make_splits(1, 20, 0)[0]:
        found = solve_countdown(ex.numbers, ex.target)
        assert found is not None and countdown.score(ex, found) == 1.0, (ex, found)
    assert solve_countdown((2, 3), 100) is None


# ---------------------------------------------------------------------------------------------- model policy, CLI
def test_model_policy_grows_the_row_by_concatenation_until_the_context(tiny_model):
    policy = ModelPolicy(tiny_model, max_new_tokens=8)
    encode = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = PlainTextTurns()
    prompt = policy.begin("Walk P to G.", "P.\n.G", seed=0)
    assert prompt == policy.row == encode(turns.first("Walk P to G.", "P.\n.G"))
    action = policy.act()
    generated = policy.row[len(prompt) :]
    assert 1 <= len(generated) <= 8 and isinstance(action.text, str) and action.ids == generated
    assert policy.observe("P.\n.G") == encode(turns.next("P.\n.G"))
    assert policy.row == prompt + generated + encode(turns.next("P.\n.G"))

    # a random model: the row fills first
    episode = run_episode(FrozenLake(max_turns=1000), policy, seed=0)
    assert episode.truncated and not episode.success and len(episode.turns) < 1000
    assert episode.length == len(policy.row) and episode.prompt == policy.row[: len(episode.prompt)]
    next_text = encode(turns.next(episode.turns[-1].observation_text))
    assert episode.length <= policy.max_len < episode.length + len(next_text)


def test_expert_policy_needs_an_expert():
    with pytest.raises(ValueError, match="no expert"):
        ExpertPolicy(object())
    with pytest.raises(ValueError, match="neither random, expert nor a model directory"):
        run_episodes("frozenlake", {}, "/nonexistent/model", episodes=1)


def test_cli_env(tmp_path, capsys):
    done = rollhpc(
        "env",
        "frozenlake",
        "--episodes",
        "5",
        "--policy",
        "expert",
        "--option",
        "size=5",
        "--show",
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "frozenlake (expert, 5 episodes): success rate 1.000" in done.stdout
    assert "--- episode seed 0" in done.stdout and "--- success after" in done.stdout
    assert cli.main(["env", "nope"]) == 2
    assert "rollhpc env: unknown environment 'nope'; shipped: " in capsys.readouterr().err
    assert cli.main(["env", "sokoban", "--option", "boxes"]) == 2
    assert "--option expects KEY=VALUE" in capsys.readouterr().err
