"""The quickstart: GRPO on the mod-sum task with a tiny torch policy, through real worker groups.

Per step: generators sample a group of answers per prompt, the reward role scores them, the
controller computes group-relative advantages, the trainers take one data-parallel step, and the
new weights go to the generators with a version number. Left out here (the RLVR pipeline adds them):
Megatron and vLLM engines, multi-token sequences, sample-level scheduling, a reference model and KL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from rollhpc.algo.advantages import GROUP_BASELINES, grpo_advantages
from rollhpc.batch import Batch
from rollhpc.protocol.pipeline import Pipeline
from rollhpc.observability.rollouts import RolloutRecord
from rollhpc.observability.run_log import RunLog
from rollhpc.tasks import modsum

log = logging.getLogger("rollhpc.toy_grpo")


class ToyGrpoPipeline(Pipeline):
    required_roles = ("train", "generate", "reward")

    @dataclass(kw_only=True)
    class Options:
        steps: int = 60
        prompts_per_step: int = 32
        group_size: int = 8
        modulus: int = 10
        eval_every: int = 10
        rollout_every: int = 1  # write rollouts/step_N.h5 every this many steps (0: never)

        def __post_init__(self) -> None:
            if self.group_size < 2:
                raise ValueError(
                    f"group_size={self.group_size}: {GROUP_BASELINES['grpo']}; set group_size >= 2"
                )

    def evaluate(self) -> float:
        prompts = modsum.all_prompts(self.options.modulus)
        answers = np.asarray(self.workers["generate"].greedy(prompts.tolist()))
        return float(modsum.reward(prompts, answers, self.options.modulus).mean())

    def run(self) -> None:
        o = self.options
        train, gen, reward = self.workers["train"], self.workers["generate"], self.workers["reward"]
        rng = np.random.default_rng(self.run_ctx.seed)
        run_log = RunLog(self.run_ctx.run_dir)
        gen.set_weights(train.weights(), 0)
        accuracy = self.evaluate()
        log.info("step 0: greedy accuracy on all prompts %.3f", accuracy)
        run_log.log_step(0, {"accuracy": accuracy})
        for step in range(1, o.steps + 1):
            times = {}
            t = time.perf_counter()
            rollouts = gen.generate(
                modsum.sample_prompts(rng, o.modulus, o.prompts_per_step), o.group_size
            )
            times["generate_s"] = time.perf_counter() - t
            t = time.perf_counter()
            scored = reward.score(rollouts)
            times["reward_s"] = time.perf_counter() - t
            rewards = scored["reward"].reshape(-1, o.group_size)
            adv = grpo_advantages(rewards).reshape(-1).astype(np.float32)
            t = time.perf_counter()
            stats = train.train_step(Batch({**scored.data, "advantage": adv}))
            times["train_s"] = time.perf_counter() - t
            t = time.perf_counter()
            gen.set_weights(train.weights(), step)
            times["weight_sync_s"] = time.perf_counter() - t
            record = {
                "step": step,
                "reward_mean": float(rewards.mean()),
                "loss": float(
                    np.average([s["loss"] for s in stats], weights=[s["n"] for s in stats])
                ),
                "entropy": float(np.mean([s["entropy"] for s in stats])),
                "policy_version": step,
                **{k: round(v, 4) for k, v in times.items()},
            }
            if step % o.eval_every == 0 or step == o.steps:
                record["accuracy"] = accuracy = self.evaluate()
            run_log.log_step(
                step, record, self._rollout_record(scored) if self._keep_rollouts(step) else None
            )
            log.info(
                "step %d/%d: reward %.3f, greedy accuracy %.3f",
                step,
                o.steps,
                record["reward_mean"],
                accuracy,
            )
        run_log.close()

    def _keep_rollouts(self, step: int) -> bool:
        every = self.options.rollout_every
        return every > 0 and (step % every == 0 or step == self.options.steps)

    @staticmethod
    def _rollout_record(scored: Batch) -> RolloutRecord:
        """Prompts are (a, b) token pairs and responses one answer token, so every sequence has a fixed length."""
        return RolloutRecord(
            prompt_tokens=scored["prompt"],
            response_tokens=scored["answer"][:, None],
            logprobs=scored["logprob"][:, None],
            reward=scored["reward"],
            version=scored["version"],
        )
