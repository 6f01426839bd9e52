"""The plan-time side of the agentic pipeline (rollhpc.pipelines.agentic): its options, the checks against the
configured roles and the expert-SFT warm start built before the world starts. Light (rollhpc.protocol.spec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rollhpc.config import from_dict
from rollhpc.envs.base import HELDOUT_SEED_BASE
from rollhpc.pipelines.training_spec import (
    TrainingOptions,
    TrainingPipelineSpec,
    check_critic_role,
    check_lora_serving,
    check_route_source,
    replayed_routes,
)
from rollhpc.warm_start.agentic_prep import prepare_agentic_policy
from rollhpc.warm_start.sft_config import SftConfig
from rollhpc.warm_start.tiny_config import TinyModelConfig

__all__ = ["AgenticPipelineSpec", "AgenticWarmStart", "StepAdvantage"]


@dataclass(kw_only=True)
class StepAdvantage:
    """GiGPO's step-level advantage (``advantage: gigpo``)."""

    gamma: float = 0.95  # discount of the return-to-go of a turn
    episode_weight: float = 1.0  # weight of the episode-level (group) advantage
    step_weight: float = 1.0  # weight of the step-level (anchor state) advantage
    scale: bool = True  # divide by the group's / anchor group's std

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 1 or self.episode_weight < 0 or self.step_weight < 0:
            raise ValueError("step_advantage needs gamma in [0, 1] and weights >= 0")


@dataclass(kw_only=True)
class AgenticWarmStart:
    """A tiny policy built here and fine-tuned on expert trajectories (``rollhpc.warm_start.agentic_prep``)."""

    seed: int = 0
    vocab_size: int = 512
    spec: dict[str, Any] = field(default_factory=dict)  # TinyModelConfig fields
    # SftConfig fields (target_accuracy: episode success)
    sft: dict[str, Any] = field(default_factory=dict)
    episodes: int = 2000  # expert episodes to learn from (training seeds)
    # characters the tokenizer keeps one token each (a grid's cells: rows of a fixed token length), e.g. "_#.B*P+\n"
    unmerged: str = ""


class AgenticPipelineSpec(TrainingPipelineSpec):
    """Agentic RL before it runs: episodes of a text environment played by the policy."""

    required_roles = ("train", "generate", "env")

    @dataclass(kw_only=True)
    # model_dir, steps, algorithm, rollout, loss, ...: TrainingOptions
    class Options(TrainingOptions):
        # here rollout.max_tokens is per turn, and PPO's GAE runs over the generated tokens of a row (the
        # environment's tokens between turns are skipped: a turn's last token looks ahead to the next turn's first)
        warm_start: AgenticWarmStart | None = None  # build it into model_dir when absent
        groups_per_step: int = 8  # groups of episodes (one reset seed each) per batch
        formulation: Literal["trajectory", "step"] = "trajectory"
        # per episode (the algorithm's estimator on returns) or per turn (GiGPO); default: per episode on
        # trajectory rows, GiGPO on step rows
        advantage: Literal["episode", "gigpo"] | None = None
        step_advantage: StepAdvantage = field(default_factory=StepAdvantage)
        train_seeds: int = 100_000  # training episodes draw reset seeds from [0, train_seeds)
        n_heldout: int = 64  # held-out episodes (seeds from HELDOUT_SEED_BASE on)
        # a held-out episode is cut after this many turns (the env's own limit first)
        eval_max_turns: int = 32
        # held-out episodes act as in training (sampled at the generators' temperature, seeded, so the same
        # weights give the same result) or greedily; a tiny greedy policy often walks in circles forever
        eval_greedy: bool = False

        def __post_init__(self) -> None:
            super().__post_init__()
            if (
                self.steps < 1
                or self.groups_per_step < 1
                or self.eval_every < 0
                or self.n_heldout < 0
            ):
                raise ValueError(
                    "steps and groups_per_step must be >= 1, eval_every and n_heldout >= 0"
                )
            if not 0 < self.train_seeds <= HELDOUT_SEED_BASE:
                raise ValueError(
                    f"train_seeds must be in (0, {HELDOUT_SEED_BASE}]: held-out seeds start there"
                )
            if self.rollout.group_size < 2 and self.algorithm in ("grpo", "rloo"):
                raise ValueError(
                    f"rollout.group_size={self.rollout.group_size} with algorithm={self.algorithm}: "
                    "a group-relative advantage needs >= 2 episodes per group"
                )
            if self.advantage is None:
                self.advantage = "gigpo" if self.formulation == "step" else "episode"
            if self.formulation == "step" and self.advantage != "gigpo":
                raise ValueError(
                    "formulation=step takes advantage=gigpo: step rows exist for per-turn advantages"
                )
            if self.algorithm == "ppo" and self.formulation != "trajectory":
                raise ValueError(
                    "algorithm=ppo takes formulation=trajectory: GAE runs along an episode's row"
                )
            if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
                raise ValueError(
                    f"gamma and lam must be in [0, 1], got gamma={self.gamma}, lam={self.lam}"
                )
            if self.advantage == "gigpo" and self.algorithm != "grpo":
                raise ValueError(
                    f"advantage=gigpo with algorithm={self.algorithm}: GiGPO's episode and step "
                    "terms are group-normalised (grpo); use algorithm=grpo"
                )
            if self.rollout.partial_rollout:
                raise ValueError(
                    "rollout.partial_rollout is for single-turn samples; episodes cut at a batch end "
                    "restart from their seed"
                )
            if self.loss.kl_coef > 0:
                raise ValueError(
                    "loss.kl_coef > 0 needs a reference role; agentic runs do not take one yet"
                )

    @classmethod
    def build_warm_start(cls, options: Options, w: AgenticWarmStart, roles: dict[str, Any]) -> None:
        """The expert-SFT warm start."""
        env_name, env_options = _env_of(roles)
        prepare_agentic_policy(
            options.model_dir,
            env=env_name,
            env_options=env_options,
            spec=from_dict(TinyModelConfig, w.spec, "pipeline.options.warm_start.spec"),
            sft=from_dict(SftConfig, w.sft, "pipeline.options.warm_start.sft"),
            seed=w.seed,
            vocab_size=w.vocab_size,
            episodes=w.episodes,
            train_seeds=options.train_seeds,
            unmerged=w.unmerged,
        )

    @classmethod
    def check_roles(cls, options: Options, roles: dict[str, Any]) -> None:
        """The env role must name its environment (the warm start plays it); PPO needs a critic role."""
        _env_of(roles)
        check_critic_role(options, roles)
        check_lora_serving(roles)
        check_route_source(roles)
        if replayed_routes(roles) == "r3":
            raise ValueError(
                "roles.train.options.router_replay=r3: an agentic row joins several turns' generations and "
                "the environment's observations, whose routes are not assembled into rows yet; use r2"
            )


def _env_of(roles: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(environment name, options) of the env role, from the configured roles."""
    env = roles.get("env")
    if env is None:
        raise ValueError(
            f"the agentic pipeline needs an 'env' role (rollhpc.workers.env:EnvWorker); configured: "
            f"{sorted(roles)}"
        )
    options = getattr(env, "options", None) or {}
    name = options.get("env") if isinstance(options, dict) else getattr(options, "env", None)
    if not name:
        raise ValueError("roles.env.options.env must name the environment (e.g. frozenlake)")
    env_options = (
        options.get("env_options", {})
        if isinstance(options, dict)
        else getattr(options, "env_options", {})
    )
    return name, dict(env_options or {})
