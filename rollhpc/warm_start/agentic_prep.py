"""The agentic pipeline's starting policy: a tiny Qwen2 model fine-tuned on an environment's expert episodes.

Why a warm start: a random tiny model never writes a valid move, let alone reaches a goal, so RL on
episode returns would have nothing to compare. ``prepare_agentic_policy`` plays expert episodes
(``expert_action``: BFS / optimal play) on training seeds, trains a tokenizer on their text, creates a
tiny model (``rollhpc.warm_start.tiny``) and fine-tunes it on every turn of every episode, stopping as soon
as the model, playing episodes, succeeds on a small share of them (``SftConfig.target_accuracy`` read as
an episode success rate). RL then starts from a policy that sometimes succeeds and has room to improve.

Why the early stop plays SAMPLED episodes by default (``stop_on="sampled"``, temperature 1, what RL's
rollouts draw) rather than greedy ones: greedy success says what the policy prefers, not how sure it is.
Measured on 4x4 FrozenLake (p=0.8): greedy success reached 0.16 after 25 steps (lr 3e-4) at a completion
loss of 3.8 nats, the argmax happening to spell a blind down/right walk (which alone solves ~0.4 of those
maps), while sampling from the same model ended 12% of its turns with EOS and solved none: RL would have
started from noise. Sampled success only rises once the policy answers with confidence, and more smoothly
(an expectation, not an argmax flipping). ``stop_on="greedy"`` stops on greedy play.
In both, an episode counts only when each of its turns stopped with EOS: lenient action parsing lets a
babbling model ("down down down ..." up to the token budget) reach a goal now and then.

Rows are built exactly as rollout builds them, by concatenating token ids
(``rollhpc.warm_start.agentic_episodes`` says how). The building itself (torch, transformers) is
``rollhpc.warm_start.agentic_build``, imported only when a directory is built: this module is read
when a config loads.

The directory is an ordinary Hugging Face model with ``sft_report.json`` (held-out greedy success rate on
seeds ``HELDOUT_SEED_BASE + i``, the seeds the agentic pipeline evaluates greedily on, so RL's first
evaluation is comparable; the sampled success rate on the same seeds, what RL's first rollouts see; the
expert's success on them; train success; mean turns; settings and their hash),
written atomically and cached like ``rollhpc.warm_start.policy_prep.prepare_policy``: the same settings reuse
it, other settings are refused (FileExistsError), never overwritten.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from rollhpc.envs import make_env
from rollhpc.envs.base import HELDOUT_SEED_BASE
from rollhpc.warm_start.agentic_episodes import MAX_TURNS
from rollhpc.warm_start.policy_prep import build_and_log
from rollhpc.warm_start.sft_config import SftConfig
from rollhpc.warm_start.tiny_config import TinyModelConfig

__all__ = ["agentic_settings", "prepare_agentic_policy", "MONITOR_EPISODES"]

# bump when a code change alters what the same settings produce (invalidates caches)
FORMAT_VERSION = 1
# training seeds the early stop plays every check_every steps (at most eval_examples)
MONITOR_EPISODES = 64


def agentic_settings(
    env: str,
    env_options: dict[str, Any],
    spec: TinyModelConfig,
    sft: SftConfig,
    seed: int,
    vocab_size: int,
    episodes: int,
    train_seeds: int,
    stop_on: Literal["sampled", "greedy"] = "sampled",
    unmerged: str = "",
) -> dict[str, Any]:
    """Everything that determines the prepared weights and report; its hash is the cache key."""
    if stop_on not in ("sampled", "greedy"):
        raise ValueError(f"stop_on must be 'sampled' or 'greedy', got {stop_on!r}")
    # absent when empty, so a policy prepared without it keeps its key
    extra = {"unmerged": unmerged} if unmerged else {}
    return {
        **extra,
        "format_version": FORMAT_VERSION,
        "kind": "agentic",
        "env": env,
        "stop_on": stop_on,
        "env_options": json.loads(json.dumps(env_options, sort_keys=True)),
        "turns": "plain",
        "seed": seed,
        "vocab_size": vocab_size,
        "episodes": episodes,
        "train_seeds": train_seeds,
        "monitor_episodes": min(MONITOR_EPISODES, sft.eval_examples, episodes),
        "max_turns": MAX_TURNS,
        "spec": asdict(spec),
        "sft": asdict(sft),
    }


def prepare_agentic_policy(
    out_dir: str | Path,
    *,
    env: str,
    env_options: dict[str, Any],
    spec: TinyModelConfig,
    sft: SftConfig,
    seed: int,
    vocab_size: int,
    episodes: int,
    train_seeds: int,
    stop_on: Literal["sampled", "greedy"] = "sampled",
    progress: bool = True,
    unmerged: str = "",
) -> Path:
    """Build, fine-tune on expert episodes and write the agentic starting policy to ``out_dir``; returns it.

    ``episodes`` expert episodes are played on distinct seeds drawn (seeded by ``seed``) from
    ``[0, train_seeds)``; every turn is an SFT example. How ``sft`` reads here:
    - ``target_accuracy``: an episode SUCCESS RATE. Every ``check_every`` steps the model plays episodes
      (sampled at temperature 1, or greedy with ``stop_on="greedy"``: module docstring) on
      ``MONITOR_EPISODES`` of the training seeds (at most ``eval_examples``; training seeds, so the held-out
      rate is not selected on) and training stops once its success rate, counting only episodes whose
      every turn stopped with EOS, reaches it (None trains all ``steps``);
    - ``eval_examples``: held-out episodes in the report (seeds ``HELDOUT_SEED_BASE + i``), and as many
      training seeds for the report's train success rate;
    - ``max_new_tokens``: tokens per turn in played episodes;
    - ``max_len`` and ``train_examples`` are not used: the rows must fit ``spec.max_position_embeddings``
      (checked, the context RL will use) and the examples are the expert's turns.

    Reuses ``out_dir`` when it holds a policy prepared with the same settings; raises FileExistsError when
    it holds anything else. Seeded like ``prepare_policy`` (same settings, same torch build and thread
    count: same weights); the caller's torch RNG is left alone.
    """
    _check_seed_counts(episodes, train_seeds)
    out_dir = Path(out_dir)
    env_options = dict(env_options or {})
    make_env(
        env, env_options
    ).close()  # a bad name or option fails here, before anything is hashed or built
    settings = agentic_settings(
        env, env_options, spec, sft, seed, vocab_size, episodes, train_seeds, stop_on, unmerged
    )
    return build_and_log(
        out_dir,
        settings,
        lambda work: _fine_tune(work, settings, spec, sft, progress),
        "sft: wrote {out_dir} in {wall_s:.0f} s ({steps} steps): held-out greedy success "
        "{heldout_success_rate:.3f} (expert {expert_success_rate:.3f}, train {train_success_rate:.3f})",
    )


def _check_seed_counts(episodes: int, train_seeds: int) -> None:
    """ValueError unless ``episodes`` distinct training seeds can be drawn from ``[0,
    train_seeds)``, below the held-out seeds."""
    if not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be a positive int, got {episodes!r}")
    if not 0 < train_seeds <= HELDOUT_SEED_BASE:
        raise ValueError(
            f"train_seeds must be in (0, {HELDOUT_SEED_BASE}] (held-out seeds start there), "
            f"got {train_seeds}"
        )
    if episodes > train_seeds:
        raise ValueError(
            f"{episodes} expert episodes need as many distinct training seeds, but train_seeds is "
            f"{train_seeds}"
        )


def _fine_tune(
    work_dir: Path, settings: dict[str, Any], spec: TinyModelConfig, sft: SftConfig, progress: bool
) -> tuple[Path, dict[str, Any]]:
    """Expert episodes, tokenizer, initial model, SFT and evaluation inside ``work_dir``; (model dir, report)."""
    # imported here: the agentic spec imports this module at config load, where torch may not load
    from rollhpc.warm_start.agentic_build import fine_tune_on_experts

    return fine_tune_on_experts(work_dir, settings, spec, sft, progress)
