"""Agentic multi-turn RL: the policy acts in text environments over several turns and learns from the returns.

One step:
  1. rollout: the sample-level scheduler (``rollhpc.rollout.scheduler``) runs episodes: a reset on an env
     rank, then generator turns and env steps alternating until the env ends the episode (or its row is
     full); the episodes of a group share the reset seed, so a group compares attempts at one task;
  2. rows: one row per episode (``formulation: trajectory``, StarPO-style: prompt || r1 || o2 || r2 ...,
     loss on generated tokens only) or one row per turn (``formulation: step``, GiGPO-style);
  3. advantages (``rollhpc.algo``): GRPO / RLOO / REINFORCE++ on episode returns (``advantage: episode``), PPO
     (a ``critic`` role's values and GAE over the generated tokens, each turn's reward on its last token), or
     GiGPO's episode-level plus step-level advantage among turns that acted in the same state (``state_key``,
     ``advantage: gigpo``). GiGPO on trajectory rows puts each turn's advantage on that turn's tokens: the
     same loss terms as step rows (a turn's tokens see the same prefix either way, attention being causal),
     at the cost of one row per episode instead of one per turn;
  4. log-probs (trainer; skipped when the trainer takes one optimizer step: the update is then on-policy and
     the train step's own forward gives them), train (the trainer's ``mini_batches`` optimizer steps), weight
     sync: as in RLVR.
Evaluation plays held-out seeds (never drawn for training, nor by the SFT warm start) and reports the success
rate, mean return and mean turns. ``success_rate`` in a step's metrics is over the episodes it trained on
(after dynamic sampling); ``rollout_success_rate`` over every episode that finished during its rollout.

The run loop (resume, evaluation schedule, metrics, checkpoints, stop requests) is the one RLVR uses
(``rollhpc.controller.run_loop``). Checkpoint-and-requeue: the checkpoint is taken between steps, when no
episode is in flight, so nothing of an episode needs saving: a resumed run draws the next seeds from the
saved seed cursor and restarts episodes from their seeds, and with deterministic settings (one generator,
no oversampling, no dynamic sampling or redundancy) it repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rollhpc.algo import advantages as adv_mod
from rollhpc.algo import agentic as agentic_adv
from rollhpc.algo.kl_control import KlController
from rollhpc.batch import Batch, TrainingBatch, ValueBatch
from rollhpc.checkpoint.run_checkpoint import RunCheckpointer
from rollhpc.protocol.pipeline import RunContext
from rollhpc.controller.run_loop import Outcome, Stateful, StepReport
from rollhpc.controller.worker_group import GroupFuture, RankProxy, RemoteMethod, WorkerGroup
from rollhpc.envs.base import HELDOUT_SEED_BASE
from rollhpc.observability.rollouts import RolloutRecord
from rollhpc.pipelines.agentic_spec import AgenticPipelineSpec
from rollhpc.pipelines.training import PolicyCursor, TrainingPipeline, step_measures
from rollhpc.rollout import rows as rows_mod
from rollhpc.rollout.ports import ResetRequest, StepRequest
from rollhpc.rollout.scheduler import RolloutScheduler
from rollhpc.rollout.episode import Episode, episode_of
from rollhpc.rollout.types import EpisodeSeed, Prompt, Sample

log = logging.getLogger("rollhpc.agentic")
# a step whose turns were cut at their token budget more often than this warns once (turns_cut_frac)
CUT_TURNS_WARNING = 0.5
# evaluation samples with the run's seed plus this: its draws are not those of the training batches' first prompts
EVAL_SEED_OFFSET = 7919


class SeedStream:
    """Endless stream of training episodes: each prompt (group) is a seed drawn from the training range.
    Its position is part of a checkpoint, so a resumed run draws the seeds the uninterrupted one would."""

    def __init__(self, seed: int, n_seeds: int):
        self._rng = random.Random(seed)
        self.n_seeds = n_seeds
        self.drawn = 0

    def __iter__(self) -> SeedStream:
        return self

    def __next__(self) -> Prompt:
        env_seed = self._rng.randrange(self.n_seeds)
        self.drawn += 1
        return Prompt(self.drawn - 1, (), EpisodeSeed(env_seed))

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self._rng.getstate(), "drawn": self.drawn, "n_seeds": self.n_seeds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.setstate(state["rng"])
        self.drawn, self.n_seeds = state["drawn"], state["n_seeds"]


def _sampled_entropy(samples: list[Sample]) -> float:
    nll = [-lp for s in samples for lp, g in zip(s.logprobs, s.episode.generated) if g]
    return float(np.mean(nll)) if nll else float("nan")


@dataclass(frozen=True)
class _EnvRank:
    """An env rank as the scheduler's ``EnvPort``: its remote methods' ``submit``, which the scheduler calls
    directly (``close`` is the env worker's ``close_episodes``)."""

    reset: Callable[[list[ResetRequest]], GroupFuture]
    step: Callable[[list[StepRequest]], GroupFuture]
    close: Callable[[list[str]], GroupFuture]

    @classmethod
    def of(cls, rank: RankProxy) -> _EnvRank:
        return cls(rank.reset.submit, rank.step.submit, rank.close_episodes.submit)


class AgenticPipeline(AgenticPipelineSpec, TrainingPipeline):
    """The controller's agentic program (``Options``, the load-time checks and the warm start: its spec,
    agentic_spec)."""

    def __init__(
        self, workers: dict[str, WorkerGroup], run: RunContext, options: AgenticPipelineSpec.Options
    ):
        super().__init__(workers, run, options)
        self.checkpointer: RunCheckpointer | None = None
        self._warned_cut_turns = False

    # ------------------------------------------------------------------ start-up
    def setup(self) -> None:
        if self.checkpointer is not None:
            return
        # transformers imports torch: loaded here, in the controller's start-up that overlaps the workers'
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.options.model_dir)
        self.checkpointer = RunCheckpointer(
            self.run_ctx.run_dir, self.workers, self.options.checkpoint
        )
        self.checkpointer.find()

    def run(self) -> Outcome:
        o = self.options
        self.setup()
        self.scheduler = RolloutScheduler(
            self._generator_ports(), None, o.rollout, seed=self.run_ctx.seed, envs=self._env_ports()
        )
        self.seeds = SeedStream(self.run_ctx.seed, o.train_seeds)
        self.kl_control = KlController(o.kl_control)
        self.policy = PolicyCursor()
        return self.run_loop()

    def _generator_ports(self) -> list[RemoteMethod]:
        gen = self.workers["generate"]
        return [gen.at(i).rollout for i in range(len(gen))]

    def _env_ports(self) -> list[_EnvRank]:
        env = self.workers["env"]
        return [_EnvRank.of(env.at(i)) for i in range(len(env))]

    # ------------------------------------------------------------------ the run loop's hooks
    def state_objects(self) -> dict[str, Stateful]:
        return {**super().state_objects(), "seeds": self.seeds}

    def checkpoint_summary(self) -> dict[str, Any]:
        return {"episode_groups_drawn": self.seeds.drawn}

    def step(self, step: int, last: bool) -> StepReport:
        o = self.options
        train = self.workers["train"]
        self.stage("generate")
        groups, rstats = self.scheduler.collect(self.seeds, o.groups_per_step, self.policy.version)
        times = {"rollout_s": rstats.wall_s}
        if not groups and rstats.resets_failed and rstats.resets_failed == rstats.episodes_started:
            raise RuntimeError(
                f"step {step}: all {rstats.episodes_started} episodes failed at their reset, e.g. "
                f"{rstats.first_failure}: the env role's environment or its options are broken"
            )
        if not groups:
            log.warning(
                "step %d: no group with differing returns in %d started; no update this step",
                step,
                rstats.groups_started,
            )
            return self.skipped_step(rstats)
        batch, critic_batch = self._training_batch(groups, times)
        self.stage("train")
        t = time.perf_counter()
        training = train.train_step.submit(batch, self.options.loss)
        critic = self.train_critic(critic_batch)  # PPO: beside the actor, on its own ranks
        stats = self.training_result(training, critic, t, times)
        self.publish_policy(times)
        samples = [s for g in groups for s in g]
        record = {
            **self._episode_metrics(samples),
            "policy_version": self.policy.version,
            "rollout_success_rate": rstats.episodes_succeeded / max(rstats.episodes_finished, 1),
            "tokens_per_s": rstats.tokens_generated / max(rstats.wall_s, 1e-9),
            "rows": len(batch),
            **step_measures(times),
            **rstats.as_metrics(),
        }
        for key in stats[0]:
            record[f"train/{key}"] = float(np.mean([s[key] for s in stats]))
        if record["turns_cut_frac"] > CUT_TURNS_WARNING and not self._warned_cut_turns:
            self._warned_cut_turns = True
            log.warning(
                "step %d: %.0f%% of the turns ran into rollout.max_tokens=%d instead of ending: the policy "
                "may have stopped ending its turns, and whatever it writes after its action is trained on "
                "that action's advantage. Read actions strictly (an environment that refuses extra text, "
                "e.g. sokoban's strict_format) or give turns more tokens",
                step,
                100 * record["turns_cut_frac"],
                o.rollout.max_tokens,
            )
        return StepReport(
            record,
            self._record(samples),
            summary=f"success {record['success_rate']:.3f}, return {record['reward_mean']:.3f}, "
            f"{record['turns_mean']:.1f} turns",
        )

    # ------------------------------------------------------------------ batch
    def _training_batch(
        self, groups: list[list[Sample]], times: dict[str, float]
    ) -> tuple[TrainingBatch, ValueBatch | None]:
        """Rows (one per episode, or one per turn), their advantages, and the trainer's old log-probs; and the
        critic's batch (PPO; else None)."""
        episodes = [[episode_of(s) for s in g] for g in groups]
        critic = None
        if self.options.advantage == "episode":
            data, advantage, critic = self._episode_advantages(episodes, times)
        else:
            data, advantage = self._turn_advantages(episodes)
        tokens, mask = data["tokens"], data["loss_mask"]
        advantage = np.asarray(advantage, dtype=np.float32)
        if (
            self.options.skip_on_policy_logprobs
            and self.trains_once_per_batch()
            and not self.options.loss.correction.enabled
        ):
            # on-policy: the train step reports its distance from the generator's log-probs (logprob_abs_diff)
            return TrainingBatch(tokens, mask, advantage, gen_logprob=data["gen_logprob"]), critic
        old = self.old_logprobs_from_trainer(
            Batch({"tokens": tokens}), mask, data["gen_logprob"], times
        )
        batch = TrainingBatch(tokens, mask, advantage, old_logprob=old)
        return self.corrected(batch, data["gen_logprob"], times), critic

    def _episode_advantages(
        self, episodes: list[list[Episode]], times: dict[str, float]
    ) -> tuple[dict[str, np.ndarray], np.ndarray, ValueBatch | None]:
        """``advantage: episode``: one row per episode (its padded arrays), the rows' advantages, and the
        critic's batch (PPO; else None)."""
        o = self.options
        rows = [rows_mod.trajectory_row(e) for g in episodes for e in g]
        data = rows_mod.pad_rows(rows, self.tokenizer.pad_token_id)
        if o.algorithm == "reinforce_pp":  # token rewards, a running baseline: no group needed
            return (
                data,
                adv_mod.reinforce_pp_advantages(data["token_rewards"], data["loss_mask"]),
                None,
            )
        if o.algorithm == "ppo":  # the critic's values, GAE along each row's generated tokens
            advantage, critic = self.ppo_advantages(
                data["tokens"], data["loss_mask"], data["token_rewards"], times
            )
            return data, advantage, critic
        returns = np.array([[e.episode_return for e in g] for g in episodes], dtype=np.float64)
        advantage = agentic_adv.trajectory_advantages(returns, o.algorithm, scale=o.grpo_scale)
        return data, advantage.reshape(-1), None

    def _turn_advantages(
        self, episodes: list[list[Episode]]
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """GiGPO: rows (one per episode or per turn, ``formulation``) with each turn's episode- plus step-level
        advantage on that turn's tokens; step rows shuffled (seeded by the policy version)."""
        o, sa = self.options, self.options.step_advantage
        rows, turn_advantages = [], []
        for g in episodes:
            per_episode = agentic_adv.gigpo_advantages(
                [[t.reward for t in e.turns] for e in g],
                [[t.state_key for t in e.turns] for e in g],
                gamma=sa.gamma,
                w_episode=sa.episode_weight,
                w_step=sa.step_weight,
                scale=sa.scale,
            )
            for e, adv in zip(g, per_episode):
                episode_rows = (
                    [rows_mod.trajectory_row(e)]
                    if o.formulation == "trajectory"
                    else rows_mod.step_rows(e)
                )
                rows += episode_rows
                turn_advantages += [adv] * len(episode_rows)
        data = rows_mod.pad_rows(rows, self.tokenizer.pad_token_id)
        advantage = agentic_adv.spread_turn_advantages(turn_advantages, data["turn_ids"])
        if o.formulation == "step":
            # the trainer's mini-batches are contiguous chunks: shuffled rows mix episodes in each one
            order = agentic_adv.minibatch_order(
                len(rows), 1, self.run_ctx.seed + self.policy.version
            )
            data = {k: v[order] for k, v in data.items()}
            advantage = advantage[order]
        return data, advantage

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Episodes on the held-out seeds, run by the rollout scheduler as training's are (one episode per seed,
        no dynamic sampling, redundancy or oversampling), sampled at the generators' temperature and seeded (the
        same weights give the same result) or greedy (``eval_greedy``), cut after ``eval_max_turns`` turns.
        ``accuracy`` is their success rate; an episode that could not start counts as a failure."""
        o = self.options
        if not o.n_heldout:
            return {}
        self.stage("generate")
        config = replace(
            o.rollout,
            group_size=1,
            redundancy=0,
            oversample=0.0,
            dynamic_sampling=False,
            max_staleness=0,
            partial_rollout=False,
            max_groups_per_batch=o.n_heldout,
            max_turns=o.eval_max_turns,
        )
        scheduler = RolloutScheduler(
            self._generator_ports(),
            None,
            config,
            seed=self.run_ctx.seed + EVAL_SEED_OFFSET,
            envs=self._env_ports(),
            temperature=0.0 if o.eval_greedy else None,
        )
        seeds = (Prompt(i, (), EpisodeSeed(HELDOUT_SEED_BASE + i)) for i in range(o.n_heldout))
        groups, _ = scheduler.collect(seeds, o.n_heldout, self.policy.version)
        episodes = [episode_of(s) for g in groups for s in g]
        return {
            "accuracy": sum(e.success for e in episodes) / o.n_heldout,
            "eval/return_mean": sum(e.episode_return for e in episodes) / o.n_heldout,
            "eval/turns_mean": sum(len(e.turns) for e in episodes) / o.n_heldout,
        }

    # ------------------------------------------------------------------ logging
    @staticmethod
    def _episode_metrics(samples: list[Sample]) -> dict[str, float]:
        eps = [s.episode for s in samples]
        n_turns = max(1, sum(len(e.turn_ends) for e in eps))
        return {
            "reward_mean": float(np.mean([s.reward for s in samples])),
            "success_rate": float(np.mean([e.success for e in eps])),
            "turns_mean": float(np.mean([len(e.turn_ends) for e in eps])),
            "row_len_mean": float(
                np.mean([len(e.prompt_ids) + len(s.response) for s, e in zip(samples, eps)])
            ),
            "env_step_s_mean": float(np.sum([e.env_step_s for e in eps]) / n_turns),
            "tool_calls_mean": float(np.mean([e.tool_calls for e in eps])),
            # mean -log p of the generated tokens as sampled: the policy's per-token entropy (at temperature 1);
            # RL that pushes down more sampled tokens than it pushes up makes it rise, the policy more random
            "sampled_entropy": _sampled_entropy(samples),
            "truncated_frac": float(np.mean([e.finish in ("truncated", "row_full") for e in eps])),
            # share of turns cut at rollout.max_tokens: near 1 means the policy no longer ends its turns
            "turns_cut_frac": float(sum(e.turns_cut for e in eps) / n_turns),
            # what the environment counts (info["metrics"] summed over an episode), per episode
            **{
                f"env/{k}": float(np.mean([e.metrics.get(k, 0.0) for e in eps]))
                for k in sorted({k for e in eps for k in e.metrics})
            },
        }

    def _record(self, samples: list[Sample]) -> RolloutRecord:
        eps = [s.episode for s in samples]
        return RolloutRecord(
            prompt_tokens=[np.asarray(e.prompt_ids) for e in eps],
            response_tokens=[np.asarray(s.response) for s in samples],
            logprobs=[np.asarray(s.logprobs, dtype=np.float32) for s in samples],
            reward=np.array([s.reward for s in samples], dtype=np.float32),
            version=np.array([s.version for s in samples], dtype=np.int64),
            prompt_text=self.tokenizer.batch_decode([e.prompt_ids for e in eps]),
            response_text=self.tokenizer.batch_decode([s.response for s in samples]),
            response_mask=[np.asarray(e.generated, dtype=np.int8) for e in eps],
            turn_ends=[np.asarray(e.turn_ends, dtype=np.int32) for e in eps],
            turn_rewards=[np.asarray(e.turn_rewards, dtype=np.float32) for e in eps],
            finish=[e.finish for e in eps],
            success=np.array([e.success for e in eps]),
        )
