"""The plan-time side of the RLVR pipeline (rollhpc.pipelines.rlvr): its options, the checks against the configured
roles, the warm start built before the world starts, and ``train --dry-run``'s preview of the prompts. Light
(rollhpc.protocol.spec): config loading, ``plan`` and ``submit --dry-run`` read it without the controller's runtime;
the preview alone loads the tokenizer (transformers), when it is asked for."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollhpc.algo.advantages import GROUP_BASELINES
from rollhpc.algo.reward_norm import RewardNormConfig
from rollhpc.config import from_dict, generator_max_model_len
from rollhpc.controller.colocation import colocation_of
from rollhpc.pipelines import domains as domains_mod
from rollhpc.pipelines.domains import DomainConfig
from rollhpc.pipelines.training_spec import (
    TrainingOptions,
    TrainingPipelineSpec,
    check_critic_role,
    check_lora_serving,
    check_route_source,
    train_lora,
)
from rollhpc.rollout.prompts import PromptRenderer, check_prompt_budget
from rollhpc.tasks import task_module
from rollhpc.warm_start.policy_prep import prepare_policy
from rollhpc.warm_start.sft_config import SftConfig
from rollhpc.warm_start.tiny_config import TinyModelConfig

__all__ = ["RlvrPipelineSpec", "TaskConfig", "WarmStart"]

log = logging.getLogger("rollhpc.rlvr")


@dataclass(kw_only=True)
class TaskConfig:
    name: str = "arithmetic"  # a module of rollhpc.tasks (arithmetic, countdown, freeform_math, pyfunc) or a path
    # the task's make_splits keywords (digits, ops, ...)
    options: dict[str, Any] = field(default_factory=dict)
    n_train: int = 20000
    n_heldout: int = 200
    split_seed: int = 1234  # ignored when model_dir has an sft_report.json (its splits are used)

    def __post_init__(self) -> None:
        task = task_module(self.name)
        # tasks over files read and validate them here, at load
        check = getattr(task, "check_options", None)
        if check is not None:
            self.options = check(dict(self.options))


@dataclass(kw_only=True)
class WarmStart:
    """A tiny policy built and fine-tuned here (``rollhpc.warm_start.policy_prep``), cached in model_dir."""

    # also the seed of the task splits: RL then trains and evaluates on the SFT's splits
    seed: int = 0
    vocab_size: int = 512
    spec: dict[str, Any] = field(default_factory=dict)  # TinyModelConfig fields
    sft: dict[str, Any] = field(default_factory=dict)  # SftConfig fields


class RlvrPipelineSpec(TrainingPipelineSpec):
    """RLVR before it runs: prompts of a task (or a mixture of domains) scored by reward roles."""

    required_roles = ("train", "generate")  # and "reward", or the reward roles each domain names

    @dataclass(kw_only=True)
    # model_dir, steps, algorithm, rollout, loss, ...: TrainingOptions
    class Options(TrainingOptions):
        # with domains: its n_train/n_heldout are the totals
        task: TaskConfig = field(default_factory=TaskConfig)
        # multi-domain RLVR (rollhpc.pipelines.domains): name -> task, share, reward roles, weights
        domains: dict[str, DomainConfig] = field(default_factory=dict)
        # build the tiny model + SFT into model_dir when it is absent
        warm_start: WarmStart | None = None
        prompts_per_step: int = 16  # groups per batch
        # coefficient of KL(policy || reference) subtracted from token rewards
        kl_in_reward: float = 0.0
        # running mean/std of rewards
        reward_norm: RewardNormConfig = field(default_factory=RewardNormConfig)
        # the behaviour policy's log-probs in the PPO ratio: recomputed by the trainer, or the generator's own.
        # Async (max_staleness >= 1) wants "generator", or "trainer" with a loss.correction (decoupled PPO): alone,
        # the trainer's are those of the weights being trained, so a one-step update has ratio 1 and its clip never
        # bounds the step away from the policy that sampled
        old_logprob_source: Literal["trainer", "generator"] = "trainer"
        eval_max_tokens: int = 16
        # prompts in the model's chat template when its tokenizer has one (auto), always (on: an error
        # without one), or plain text (off); rollhpc.rollout.prompts
        chat_template: Literal["auto", "on", "off"] = "auto"

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.steps < 1 or self.prompts_per_step < 1 or self.eval_every < 0:
                raise ValueError("steps and prompts_per_step must be >= 1, eval_every >= 0")
            self._check_group_size()
            if self.loss.correction.enabled and self.old_logprob_source == "generator":
                raise ValueError(
                    "loss.correction weighs the trainer's old log-probs against the generator's: it needs "
                    "old_logprob_source=trainer (with generator both are the generator's and every weight is 1)"
                )
            if (
                self.rollout.max_staleness >= 1
                and self.old_logprob_source == "trainer"
                and not self.loss.correction.enabled
            ):
                log.warning(
                    "rollout.max_staleness=%d with old_logprob_source=trainer and no loss.correction: the PPO "
                    "clip does not bound updates on samples of older weights; old_logprob_source=generator "
                    "does, and so does a loss.correction (decoupled PPO) (README, 'How a run is built')",
                    self.rollout.max_staleness,
                )
            if (
                self.kl_control.kind == "adaptive"
                and self.loss.kl_coef == 0
                and self.kl_in_reward == 0
            ):
                raise ValueError(
                    "kl_control.kind=adaptive scales loss.kl_coef and kl_in_reward: set one of them > 0"
                )
            if self.domains and (self.task.name != TaskConfig.name or self.task.options):
                raise ValueError(
                    "set either task.name/task.options (one domain) or domains (each names its own task "
                    "and options), not both; with domains, task.n_train and task.n_heldout are totals"
                )

        @property
        def task_name(self) -> str:
            """The task the policy is trained and evaluated on: with domains, their mixture."""
            return "mixture" if self.domains else self.task.name

        @property
        def task_options(self) -> dict[str, Any]:
            return domains_mod.mixture_options(self.domains) if self.domains else self.task.options

        def _check_group_size(self) -> None:
            """A group too small to learn from would train on zero advantages (or none) without failing."""
            size = self.rollout.group_size
            if size < 2 and self.algorithm in GROUP_BASELINES:
                raise ValueError(
                    f"rollout.group_size={size} with algorithm={self.algorithm}: "
                    f"{GROUP_BASELINES[self.algorithm]}; set rollout.group_size >= 2, or use a baseline "
                    "that needs no group (algorithm=reinforce_pp, or ppo with a critic role) with "
                    "rollout.dynamic_sampling=false"
                )
            if size < 2 and self.rollout.dynamic_sampling:
                raise ValueError(
                    f"rollout.group_size={size} with rollout.dynamic_sampling=true: dynamic sampling "
                    "drops every group whose rewards are all equal, as a group of one always is, so no "
                    "step would get a sample; set rollout.dynamic_sampling=false or rollout.group_size "
                    ">= 2"
                )

    @classmethod
    def data_paths(cls, options: Options) -> list[tuple[str, str]]:
        """Dataset files the task reads (``config.missing_inputs`` checks they exist), with their config keys."""
        if options.domains:
            found = []
            for name, d in options.domains.items():
                paths = getattr(task_module(d.task), "data_paths", None)
                found += [
                    (f"pipeline.options.domains.{name}.options.{k}", p)
                    for k, p in (paths(d.options) if paths else [])
                ]
            return found
        paths = getattr(task_module(options.task.name), "data_paths", None)
        return [
            (f"pipeline.options.task.options.{k}", p)
            for k, p in (paths(options.task.options) if paths else [])
        ]

    @staticmethod
    def prompt_splits(
        options: Options, train: list, heldout: list
    ) -> list[tuple[str, list, str, int]]:
        """Each split's prompts with the response budget they are generated with (``check_prompt_budget``)."""
        return [
            ("training", train, "rollout.max_tokens", options.rollout.max_tokens),
            ("held-out", heldout, "eval_max_tokens", options.eval_max_tokens),
        ]

    @classmethod
    def preview(
        cls, options: Options, n: int = 2, roles: dict[str, Any] | None = None
    ) -> list[str]:
        """For ``rollhpc train --dry-run``: the first training prompts exactly as the policy will see them
        (chat template or plain text), with their token counts, and the longest prompt of each split against
        the generator's ``max_model_len`` (ValueError when one does not fit). Needs the model's tokenizer here."""
        # the preview alone needs the tokenizer: not at the top
        from transformers import (
            AutoTokenizer,
        )

        model_dir = Path(options.model_dir)
        if not (model_dir / "config.json").is_file():
            return [
                f"prompts: not shown, {model_dir} is not there yet"
                + (" (the warm start builds it)" if options.warm_start is not None else "")
            ]
        absent = [key for key, p in cls.data_paths(options) if not Path(p).is_file()]
        if absent:
            return [f"prompts: not shown, the dataset files of {', '.join(absent)} are not here"]
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        render = PromptRenderer(tokenizer, options.chat_template)
        opts = {k: tuple(v) if isinstance(v, list) else v for k, v in options.task_options.items()}
        train, heldout = task_module(options.task_name).make_splits(
            options.task.split_seed, options.task.n_train, options.task.n_heldout, **opts
        )
        how = (
            "in the model's chat template"
            if render.uses_template
            else "plain text, no chat template"
        )
        lines = [f"prompts ({how}), the first {len(train[:n])} of task {options.task_name}:"]
        for i, ex in enumerate(train[:n], 1):
            lines.append(
                f"--- prompt {i}: {len(render(ex))} tokens, reference answer {getattr(ex, 'answer', '?')!r}"
            )
            lines.append(render.text(ex))
        lines.append(
            "prompt lengths: "
            + check_prompt_budget(
                render, cls.prompt_splits(options, train, heldout), generator_max_model_len(roles)
            )
        )
        return lines

    @classmethod
    def check_roles(cls, options: Options, roles: dict[str, Any]) -> None:
        """Cross-checks between the options and the configured roles, run when the config is loaded."""
        if options.domains:
            domains_mod.check_domains(options.domains, roles)
        elif "reward" not in roles:
            raise ValueError(
                f"the pipeline needs a 'reward' role (or domains naming their reward roles); "
                f"configured: {sorted(roles)}"
            )
        check_critic_role(options, roles)
        check_lora_serving(roles)
        check_route_source(roles)
        lora = train_lora(roles)
        if lora is not None and "reference" in roles:
            raise ValueError(
                "roles.train.options.lora: the frozen base is the reference policy (the train role's "
                "compute_ref_logprobs); remove the 'reference' role, which would hold a second copy"
            )
        if (
            (options.loss.kl_coef > 0 or options.kl_in_reward > 0)
            and "reference" not in roles
            and lora is None
        ):
            raise ValueError(
                "a KL term (loss.kl_coef or kl_in_reward > 0) needs a 'reference' role "
                "(rollhpc.workers.megatron_policy:MegatronReferenceWorker), or LoRA on the train role"
            )
        if options.offload and options.rollout.max_staleness >= 1 and "generate" in roles:
            if not colocation_of(roles).alone("generate", roles["generate"].procs):
                raise ValueError(
                    "offload=true with rollout.max_staleness >= 1: async generation runs during training, but every "
                    "generator rank shares its devices with roles that take turns, so none could generate then; give "
                    "the trainer part of the generators' GPUs (a partial overlap, e.g. roles.train.devices "
                    "[0, 1, 2, 3] of roles.generate.devices [0, ..., 7]) or use one of the two"
                )

    @classmethod
    def build_warm_start(cls, options: Options, w: WarmStart, roles: dict[str, Any]) -> None:
        """Build and SFT the starting policy the warm start ``w`` asks for."""
        prepare_policy(
            options.model_dir,
            task=options.task_name,
            task_options=options.task_options,
            spec=from_dict(TinyModelConfig, w.spec, "pipeline.options.warm_start.spec"),
            sft=from_dict(SftConfig, w.sft, "pipeline.options.warm_start.sft"),
            seed=w.seed,
            vocab_size=w.vocab_size,
        )
